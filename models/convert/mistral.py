"""Mistral (``model_type: mistral``) <-> ``DecoderLM``: a Llama with sliding-window attention in every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# MistralConfig's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6, "sliding_window": 4096, "rope_theta": 10000.0,
}


def mistral_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """Mistral's changes to Llama's fields: no biases, and ``sliding_window`` as the attention option ``window``.

    Args:
        cfg: the checkpoint's config.
        fields: Llama's zoo config fields.

    Returns:
        ``fields``, with the window added.

    Raises:
        ValueError: biases, or a window that is not a positive integer or null.
    """
    if cfg["attention_bias"] or cfg["mlp_bias"]:
        raise cfg.unsupported("attention_bias", "biases (Mistral has none)", "attention_bias=False")
    window = cfg["sliding_window"]
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise cfg.unsupported("sliding_window", "the attention window", "a positive integer or null")
        fields["options"] = {**fields["options"], "attention": {"window": window}}
    return fields


@register_converter("mistral")
def convert_mistral(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``MistralForCausalLM`` checkpoint; ``sliding_window`` becomes the attention option ``window``.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Llama, or a bad ``sliding_window``.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_llama_like("mistral", hf_config, state_dict, DEFAULTS, mistral_fields)


@register_exporter("mistral")
def export_mistral(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``MistralForCausalLM`` config and state dict for a Mistral-shaped ``DecoderLM`` (one window for all layers).

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: biases, per-layer windows, or other parts Mistral lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"window"})
        require(not c.layer_options, "per-layer options (Mistral's layers are all alike)")
        require(not c.bias, "bias=True (Mistral has no biases)")
        return {"sliding_window": attention.get("window")}

    return export_llama_like(model, "mistral", "MistralForCausalLM", extra)


DecoderLM.register_preset("mistral-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"attention": {"window": 8}},
))
DecoderLM.register_preset("mistral-7b-v0.1", dict(
    vocab_size=32000, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, n_layers=32, max_len=32768, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"attention": {"window": 4096}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("mistral", "model.", decoder_classes("model.", "model.", stem="Mistral")))
