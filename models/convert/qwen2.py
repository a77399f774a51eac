"""Qwen2 (``model_type: qwen2``) <-> ``DecoderLM``: a Llama with biases on the q/k/v projections only, and optional
sliding windows in the layers from ``max_window_layers`` on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like, sliding_layer_options
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Qwen2Config's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "rope_theta": 10000.0,
}


def window_layers(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """Sliding windows of Qwen-style configs: ``layer_types`` if given, else layers ``>= max_window_layers``.

    Args:
        cfg: the checkpoint's config.
        fields: the zoo config fields so far.

    Returns:
        ``fields`` with ``layer_options`` set when ``use_sliding_window``.
    """
    if not cfg["use_sliding_window"]:
        return fields
    window, n_layers = cfg.positive_int("sliding_window"), fields["n_layers"]
    if cfg.data.get("layer_types") is not None:
        fields["layer_options"] = sliding_layer_options(cfg, n_layers, window)
    else:
        first = cfg["max_window_layers"]
        windowed = {"attention": {"window": window}}
        fields["layer_options"] = tuple(windowed if i >= first else {} for i in range(n_layers))
    return fields


def _qwen2_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    # Qwen2's attention has biases on q, k and v (not on o_proj); the MLP has none.
    fields["bias"] = False
    fields["options"] = {**fields["options"], "attention": {"qkv_bias": True}}
    return window_layers(cfg, fields)


def qwen_window_fields(c: DecoderLMConfig) -> dict[str, Any]:
    """``use_sliding_window``, ``sliding_window`` and ``layer_types`` of a Qwen-style export.

    Args:
        c: the zoo model's config.

    Returns:
        The ``config.json`` fields (``max_window_layers`` too when some layer has a window).

    Raises:
        NotExportable: layers with different window sizes.
    """
    windows = {entry.get("attention", {}).get("window") for entry in c.layer_options} - {None}
    require(len(windows) <= 1, f"several window sizes {sorted(windows)}")
    if not windows:
        return {"use_sliding_window": False}
    types = ["sliding_attention" if e.get("attention", {}).get("window") else "full_attention" for e in c.layer_options]
    return {"use_sliding_window": True, "sliding_window": windows.pop(), "layer_types": types,
            "max_window_layers": types.index("sliding_attention")}


@register_converter("qwen2")
def convert_qwen2(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Qwen2ForCausalLM`` checkpoint.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Llama, or a bad window setting.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_llama_like("qwen2", hf_config, state_dict, DEFAULTS, _qwen2_fields)


@register_exporter("qwen2")
def export_qwen2(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Qwen2ForCausalLM`` config and state dict for a Qwen2-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: no q/k/v biases, FFN biases, q/k norms, or other parts Qwen2 lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"qkv_bias"})
        require(attention.get("qkv_bias") is True and not c.bias, "Qwen2 has biases on q/k/v only")
        return qwen_window_fields(c)

    return export_llama_like(model, "qwen2", "Qwen2ForCausalLM", extra)


DecoderLM.register_preset("qwen2-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=2,
    options={"positional": {"base": 1000000.0}, "attention": {"qkv_bias": True}},
))
DecoderLM.register_preset("qwen2.5-0.5b", dict(
    vocab_size=151936, d_model=896, n_heads=14, n_kv_heads=2, d_ff=4864, n_layers=24, max_len=32768, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=True, pad_token_id=None, bos_token_id=151643, eos_token_id=151643,
    options={"positional": {"base": 1000000.0}, "attention": {"qkv_bias": True}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("qwen2", "model.", decoder_classes("model.", "transformer.", stem="Qwen2")))
