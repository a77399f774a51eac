"""Gemma 3 text (``model_type: gemma3_text``) <-> ``DecoderLM``: a Gemma 2 (see ``models.convert.gemma2``) with

- an offset RMSNorm on each head of q and k before rotary (attention option ``qk_norm="rmsnorm_offset"``);
- no soft-capping by default (both caps are read as Gemma 2's are, when set);
- its own RoPE per layer type: ``rope_parameters["full_attention"]`` (base 1e6, linear scaling in the larger
  models) is the stack's rotary, ``rope_parameters["sliding_attention"]`` (base 10000) the sliding layers'
  (``layer_options`` positional entries, scaling switched off there); older files give ``rope_theta``,
  ``rope_local_base_freq`` and a ``rope_scaling`` of the global layers;
- five sliding layers to one global one (``layer_types``; Gemma3TextConfig's default pattern when absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM
from .export import register_exporter, require
from .gemma2 import NAMES as GEMMA2_NAMES
from .gemma2 import convert_gemma_like, export_gemma_like, gemma2_fields
from .hf_checkpoint import HFConfig, rope_parameters
from .name_maps import NameMap
from .registry import Converted, register_converter

# Gemma3TextConfig's defaults in transformers 5 (Gemma 3 4B's text shape).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
}

NAMES = NameMap(
    top=GEMMA2_NAMES.top,
    layer={**GEMMA2_NAMES.layer, "self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"},
    stacks=GEMMA2_NAMES.stacks,
)


def _rope(cfg: HFConfig, kind: str) -> dict[str, Any]:
    """The rotary options of one layer type: ``rope_parameters[kind]`` (transformers 5), else the older fields."""
    entry = (cfg.data.get("rope_parameters") or {}).get(kind)
    if entry is None:
        old = {"full_attention": ("rope_theta", cfg.data.get("rope_scaling")),
               "sliding_attention": ("rope_local_base_freq", None)}[kind]
        entry = {**(old[1] or {}), "rope_theta": float(cfg[old[0]])}
    options = cfg.rope_options(10000.0, dict(entry))
    if "fraction" in options:
        raise ValueError(f"gemma3_text checkpoint has partial_rotary_factor={options['fraction']}; Gemma 3 rotates "
                         "every dimension of each head")
    return options


def _layer_types(cfg: HFConfig, n_layers: int) -> list[str]:
    types = cfg["layer_types"]
    if types is None:  # Gemma3TextConfig: every sixth layer global
        pattern = cfg.data.get("sliding_window_pattern", cfg.data.get("_sliding_window_pattern", 6))
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise cfg.unsupported("layer_types", "per-layer attention types",
                              f"a list of {n_layers} entries 'full_attention' or 'sliding_attention'")
    return types


def gemma3_fields(cfg: HFConfig) -> dict[str, Any]:
    """The ``DecoderLMConfig`` fields of a Gemma 3 text checkpoint (Gemma 2's, then what Gemma 3 changes).

    Args:
        cfg: the checkpoint's config.

    Returns:
        The fields, as keyword arguments of ``DecoderLMConfig``.
    """
    n_layers = cfg.positive_int("num_hidden_layers")
    types = _layer_types(cfg, n_layers)
    shared = HFConfig("gemma3_text", {**cfg.data, "layer_types": types,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, DEFAULTS)
    fields = gemma2_fields(shared)
    attention = {**fields["options"]["attention"], "qk_norm": "rmsnorm_offset", "qk_norm_eps": fields["norm_eps"]}
    global_rope, local_rope = _rope(cfg, "full_attention"), _rope(cfg, "sliding_attention")
    local = {**local_rope, "scaling": local_rope.get("scaling")}  # no global scaling on the sliding layers
    window = cfg.positive_int("sliding_window")
    fields["layer_options"] = tuple(
        {"attention": {"window": window}, "positional": local} if t == "sliding_attention" else {} for t in types
    )
    fields["options"] = {"positional": global_rope, "attention": attention}
    return fields


@register_converter("gemma3_text")
def convert_gemma3(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Gemma3ForCausalLM`` (text) checkpoint (see the module docstring for the mapping).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: a config value the zoo cannot represent (named), or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_gemma_like("gemma3_text", hf_config, state_dict, DEFAULTS, gemma3_fields, NAMES)


@register_exporter("gemma3_text")
def export_gemma3(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Gemma3ForCausalLM`` config and state dict for a Gemma-3-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: what Gemma 3 lacks (no offset q/k norm, global layers with their own rotary, sliding layers
            with rotary scaling, several window sizes, ...), named.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    attention = c.block_options("attention")
    require(attention.get("qk_norm") == "rmsnorm_offset" and attention.get("qk_norm_eps") == c.norm_eps,
            "attention without an offset RMSNorm on q and k of the model's eps")
    global_rope = c.block_options("positional")
    local_ropes = []
    for i, entry in enumerate(c.layer_options or ({},) * c.n_layers):
        rope = entry.get("positional")
        windowed = entry.get("attention", {}).get("window") is not None
        require((rope is not None) == windowed, f"layer_options[{i}]: Gemma 3 gives sliding layers (only) their "
                                                "own rotary")
        if rope is not None:
            require(rope.get("scaling") is None and set(rope) <= {"base", "scaling"},
                    f"layer_options[{i}] rotary {rope}")
            local_ropes.append(rope.get("base", 10000.0))
    require(len(set(local_ropes)) <= 1, f"several sliding-layer rotary bases {sorted(set(local_ropes))}")
    config, state = export_gemma_like(model, frozenset({"scale", "softcap", "bias", "qk_norm", "qk_norm_eps"}),
                                      frozenset({"attention", "positional"}), NAMES)
    local_base = local_ropes[0] if local_ropes else DEFAULTS["rope_local_base_freq"]
    config.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], rope_parameters={
        "full_attention": rope_parameters(global_rope),
        "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
    })
    return config, state


def _layers(n: int, window: int, local_base: float = 10000.0) -> tuple[dict[str, Any], ...]:
    """Five sliding layers to one global one, the sliding ones with their own rotary base."""
    return tuple({} if (i + 1) % 6 == 0 else {"attention": {"window": window},
                                              "positional": {"base": local_base, "scaling": None}}
                 for i in range(n))


# A tiny Gemma 3 for tests (GQA, a window shorter than test sequences, one global layer in six) and Gemma 3 1B's
# published text shape.
DecoderLM.register_preset("gemma3-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_head=32, d_ff=128, n_layers=6, max_len=256, dropout=0.0,
    positional="rotary", ffn="geglu_tanh", norm="rmsnorm_offset", norm_eps=1e-6, sublayer="sandwich_norm",
    bias=False, tie_embeddings=True, scale_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    options={"positional": {"base": 1000000.0},
             "attention": {"scale": 32 ** -0.5, "qk_norm": "rmsnorm_offset", "qk_norm_eps": 1e-6}},
    layer_options=_layers(6, 8),
))
DecoderLM.register_preset("gemma-3-1b", dict(
    vocab_size=262144, d_model=1152, n_heads=4, n_kv_heads=1, d_head=256, d_ff=6912, n_layers=26, max_len=32768,
    dropout=0.0, positional="rotary", ffn="geglu_tanh", norm="rmsnorm_offset", norm_eps=1e-6,
    sublayer="sandwich_norm", bias=False, tie_embeddings=True, scale_embeddings=True,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
    options={"positional": {"base": 1000000.0},
             "attention": {"scale": 256 ** -0.5, "qk_norm": "rmsnorm_offset", "qk_norm_eps": 1e-6}},
    layer_options=_layers(26, 512),
))
