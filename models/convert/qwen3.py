"""Qwen3 (``model_type: qwen3``) <-> ``DecoderLM``: a Llama with RMSNorm on each head of q and k (before rotary)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like
from .qwen2 import qwen_window_fields, window_layers
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Qwen3Config's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "head_dim": 128,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "rope_theta": 10000.0,
}


def _qwen3_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    attention = {**fields["options"].get("attention", {}), "qk_norm": "rmsnorm", "qk_norm_eps": fields["norm_eps"]}
    fields["options"] = {**fields["options"], "attention": attention}
    return window_layers(cfg, fields)


@register_converter("qwen3")
def convert_qwen3(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Qwen3ForCausalLM`` checkpoint (``q_norm``/``k_norm`` become the attention option ``qk_norm``).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Llama.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_llama_like("qwen3", hf_config, state_dict, DEFAULTS, _qwen3_fields)


@register_exporter("qwen3")
def export_qwen3(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Qwen3ForCausalLM`` config and state dict for a Qwen3-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: no RMSNorm q/k norms (with the model's eps), or other parts Qwen3 lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"qk_norm", "qk_norm_eps", "bias"})
        require(attention.get("qk_norm") == "rmsnorm" and attention.get("qk_norm_eps") == c.norm_eps,
                "Qwen3 has RMSNorm q/k norms with the model's eps")
        bias = attention.get("bias", c.bias)
        require(not c.bias, "biases on the FFN (Qwen3's MLP has none)")
        return {"attention_bias": bias, **qwen_window_fields(c)}

    return export_llama_like(model, "qwen3", "Qwen3ForCausalLM", extra)


DecoderLM.register_preset("qwen3-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_head=32, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=2,
    options={"positional": {"base": 1000000.0}, "attention": {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6}},
))
DecoderLM.register_preset("qwen3-0.6b", dict(
    vocab_size=151936, d_model=1024, n_heads=16, n_kv_heads=8, d_head=128, d_ff=3072, n_layers=28, max_len=40960,
    dropout=0.0, positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=True, pad_token_id=None, bos_token_id=151643, eos_token_id=151645,
    options={"positional": {"base": 1000000.0}, "attention": {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("qwen3", "model.", decoder_classes("model.", "transformer.", stem="Qwen3")))
