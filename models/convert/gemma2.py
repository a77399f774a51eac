"""Gemma 2 (``model_type: gemma2``) <-> ``DecoderLM``.

A Gemma 2 is a Llama-shaped decoder with these differences, each a zoo option:

- embeddings scaled by ``sqrt(hidden_size)`` (``scale_embeddings``);
- RMSNorm scaled by ``(1 + weight)`` in float32 (norm ``rmsnorm_offset``);
- a norm on both sides of each sublayer (sublayer ``sandwich_norm``: ``post_attention_layernorm`` and
  ``post_feedforward_layernorm`` are the sublayers' ``post_norm``);
- a GeGLU FFN with the tanh GELU (``geglu_tanh``);
- attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (attention option ``scale``) and soft-capped
  (``softcap``), final logits soft-capped (``logit_softcap``);
- layers alternating sliding-window and global attention, as ``layer_types`` says (``layer_options`` windows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, rope_parameters, zoo_config
from .llama import GATED_ACTIVATIONS, GATED_FFNS
from .name_maps import NameMap, read_mapped, write_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Gemma2Config's defaults in transformers 5 (Gemma 2 2B's shape).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
}

NAMES = NameMap(
    top={"embed_tokens": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"},
    layer={
        "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
        "self_attn.v_proj": "self_attn.v_proj", "self_attn.o_proj": "self_attn.o_proj",
        "ffn.gate_proj": "mlp.gate_proj", "ffn.up_proj": "mlp.up_proj", "ffn.down_proj": "mlp.down_proj",
        "self_attn_sublayer.norm": "input_layernorm", "self_attn_sublayer.post_norm": "post_attention_layernorm",
        "ffn_sublayer.norm": "pre_feedforward_layernorm", "ffn_sublayer.post_norm": "post_feedforward_layernorm",
    },
    stacks={"layers": "model.layers.{i}"},
)


def _optional_cap(cfg: HFConfig, key: str) -> float | None:
    """A soft-capping field: None (off) or a positive number."""
    value = cfg[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise cfg.unsupported(key, "tanh soft-capping", f"{key}=null or a finite number > 0")
    return float(value)


def gemma2_layer_types(cfg: HFConfig, n_layers: int) -> list[str]:
    """``layer_types``, or Gemma2Config's default when absent: sliding attention on even layers (0, 2, ...).

    Args:
        cfg: the checkpoint's config.
        n_layers: the number of layers.

    Returns:
        ``"full_attention"`` or ``"sliding_attention"`` per layer.

    Raises:
        ValueError: a list of the wrong length or with types other than full and sliding attention.
    """
    types = cfg["layer_types"]
    if types is None:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise cfg.unsupported("layer_types", "per-layer attention types",
                              f"a list of {n_layers} entries 'full_attention' or 'sliding_attention'")
    return types


def gemma2_fields(cfg: HFConfig) -> dict[str, Any]:
    """The ``DecoderLMConfig`` fields of a Gemma 2 checkpoint.

    Args:
        cfg: the checkpoint's config.

    Returns:
        The fields, as keyword arguments of ``DecoderLMConfig``.

    Raises:
        ValueError: bidirectional attention, an activation without a gated zoo FFN, partial rotary (Gemma 2's
            rotary ignores it), a RoPE type other than default/linear/llama3, a bad window, scale or cap.
    """
    if cfg["use_bidirectional_attention"]:
        raise cfg.unsupported("use_bidirectional_attention", "bidirectional attention in a decoder",
                              "use_bidirectional_attention=False or null")
    d_model = cfg.positive_int("hidden_size")
    n_heads = cfg.positive_int("num_attention_heads")
    n_kv_heads = n_heads if cfg["num_key_value_heads"] is None else cfg.positive_int("num_key_value_heads")
    d_head = cfg.positive_int("head_dim")
    n_layers = cfg.positive_int("num_hidden_layers")
    act = cfg["hidden_activation"]
    if act not in GATED_FFNS:
        raise cfg.unsupported("hidden_activation", "the gated FFN's activation",
                              "the activations " + ", ".join(GATED_FFNS))
    rotary = cfg.rope_options(10000.0)
    if "fraction" in rotary:
        # Gemma 2's rotary always turns the whole head; a partial factor would be silently ignored there.
        raise ValueError(f"gemma2 checkpoint has partial_rotary_factor={rotary['fraction']} (partial rotary); "
                         "Gemma 2 rotates every dimension of each head, so the zoo represents only 1.0")
    scalar = cfg["query_pre_attn_scalar"]
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < math.inf:
        raise cfg.unsupported("query_pre_attn_scalar", "the attention scale query_pre_attn_scalar ** -0.5",
                              "a finite number > 0")
    attention: dict[str, Any] = {"scale": float(scalar) ** -0.5}
    softcap = _optional_cap(cfg, "attn_logit_softcapping")
    if softcap is not None:
        attention["softcap"] = softcap
    if cfg["attention_bias"]:
        attention["bias"] = True  # q, k, v and o; Gemma 2's MLP has no biases
    types = gemma2_layer_types(cfg, n_layers)
    layer_options: tuple[dict[str, Any], ...] = ()
    if "sliding_attention" in types:
        window = cfg.positive_int("sliding_window")
        layer_options = tuple({"attention": {"window": window}} if t == "sliding_attention" else {} for t in types)
    return dict(
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        d_head=d_head, d_ff=cfg.positive_int("intermediate_size"), n_layers=n_layers,
        max_len=cfg.positive_int("max_position_embeddings"), dropout=0.0,
        attention_dropout=cfg.probability("attention_dropout"), positional="rotary", ffn=GATED_FFNS[act],
        norm="rmsnorm_offset", norm_eps=float(cfg["rms_norm_eps"]), sublayer="sandwich_norm", bias=False,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), scale_embeddings=True,
        logit_softcap=_optional_cap(cfg, "final_logit_softcapping"),
        options={"positional": rotary, "attention": attention}, layer_options=layer_options,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
    )


@register_converter("gemma2")
def convert_gemma2(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Gemma2ForCausalLM`` checkpoint (see the module docstring for the mapping).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: a config value the zoo cannot represent (named), or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_gemma_like("gemma2", hf_config, state_dict, DEFAULTS, gemma2_fields, NAMES)


def convert_gemma_like(
    model_type: str, hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor], defaults: Mapping[str, Any],
    fields: Callable[[HFConfig], dict[str, Any]], names: NameMap,
) -> Converted:
    """Gemma 2's conversion, for Gemma 2 and the families built on it (their own ``fields`` and tensor ``names``).

    Args:
        model_type: the family.
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.
        defaults: the family's config defaults.
        fields: reads the zoo config fields from the config.
        names: the zoo -> ``transformers`` tensor names.

    Returns:
        The zoo ``DecoderLM``, its config and state dict.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    cfg = HFConfig(model_type, hf_config, defaults)
    config = zoo_config(model_type, DecoderLMConfig, **fields(cfg))
    ckpt = CheckpointReader(model_type, state_dict, ignore=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"])
    tied = config.tie_embeddings
    out = read_mapped(ckpt, names, DecoderLM, config, skip=("lm_head.weight",) if tied else ())
    if tied:
        ckpt.skip("lm_head.weight")  # the tied copy some versions save
    ckpt.finish()
    return Converted(DecoderLM, config, out)


def _query_pre_attn_scalar(c: DecoderLMConfig, scale: float | None) -> int:
    """The integer ``query_pre_attn_scalar`` whose ``** -0.5`` is the attention scale (Gemma2Config types it int)."""
    if scale is None:
        return c.d_head
    scalar = 1.0 / (scale * scale)
    nearest = round(scalar)
    require(nearest >= 1 and math.isclose(scalar, nearest, rel_tol=1e-9),
            f"attention scale {scale} (Gemma 2's is query_pre_attn_scalar ** -0.5 for an integer scalar)")
    return nearest


@register_exporter("gemma2")
def export_gemma2(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Gemma2ForCausalLM`` config and state dict for a Gemma-2-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: a model with parts Gemma 2 lacks (not offset RMSNorm with sandwich sublayers, unscaled
            embeddings, FFN biases, several window sizes, ...), named.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    return export_gemma_like(model)


def export_gemma_like(
    model: nn.Module, attention_keys: frozenset[str] = frozenset({"scale", "softcap", "bias"}),
    layer_keys: frozenset[str] = frozenset({"attention"}), names: NameMap = NAMES,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Gemma 2's export, for Gemma 2 and the families built on it (which allow more ``attention_keys`` options,
    ``layer_keys`` entries and tensor ``names``, and fix the config up).

    Args:
        model: the zoo ``DecoderLM``.
        attention_keys: the attention options the family writes.
        layer_keys: the per-layer option blocks the family writes.
        names: the zoo -> ``transformers`` tensor names.

    Returns:
        ``(config, state_dict)`` under ``transformers`` names.

    Raises:
        NotExportable: a model with parts Gemma 2 lacks, named.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.positional == "rotary", f"positional={c.positional!r} (only 'rotary')")
    require(c.norm == "rmsnorm_offset", f"norm={c.norm!r} (only 'rmsnorm_offset')")
    require(c.sublayer == "sandwich_norm", f"sublayer={c.sublayer!r} (only 'sandwich_norm')")
    require(c.layer == "decoder", f"layer={c.layer!r} (only 'decoder')")
    require(c.ffn in GATED_ACTIVATIONS, f"ffn={c.ffn!r} (one of {sorted(GATED_ACTIVATIONS)})")
    require(c.attention == "mha" and c.d_value == c.d_head, "attention other than 'mha' with d_value == d_head")
    require(c.d_model % c.n_heads == 0, f"d_model={c.d_model} not divisible by n_heads={c.n_heads}")
    require(c.scale_embeddings, "scale_embeddings=False (Gemma 2 scales embeddings by sqrt(d_model))")
    require(c.output_scale == 1.0, f"output_scale={c.output_scale}")
    require(not c.bias, "bias=True (Gemma 2's MLP has no biases)")
    other = sorted(set(c.options) - {"positional", "attention"})
    require(not other, f"options for {other}")
    rotary = c.block_options("positional")
    require(set(rotary) <= {"base", "scaling"}, f"rotary options {sorted(set(rotary) - {'base', 'scaling'})}")
    attention = c.block_options("attention")
    require(set(attention) <= attention_keys, f"attention options {sorted(set(attention) - attention_keys)}")
    windows = []
    for i, entry in enumerate(c.layer_options):
        require(set(entry) <= layer_keys and set(entry.get("attention", {})) <= {"window"},
                f"layer_options[{i}] = {entry}")
        windows.append(entry.get("attention", {}).get("window"))
    sizes = set(windows) - {None}
    require(len(sizes) <= 1, f"several window sizes {sorted(sizes)}")
    config: dict[str, Any] = {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head,
        "hidden_activation": GATED_ACTIVATIONS[c.ffn], "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings, "attention_dropout": c.attention_dropout,
        "attention_bias": bool(attention.get("bias", False)),
        "rope_parameters": rope_parameters(c.block_options("positional")),
        "query_pre_attn_scalar": _query_pre_attn_scalar(c, attention.get("scale")),
        "attn_logit_softcapping": attention.get("softcap"), "final_logit_softcapping": c.logit_softcap,
        # Every layer global unless it has a window; an unused sliding_window keeps Gemma2Config's default.
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows or [None] * c.n_layers],
        "sliding_window": sizes.pop() if sizes else DEFAULTS["sliding_window"],
        "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
    }
    out = write_mapped(tensors(model), names, skip=("lm_head.weight",) if c.tie_embeddings else ())
    return config, out


# A tiny Gemma 2 for tests (GQA, head_dim != d_model / n_heads, a window shorter than test sequences) and
# Gemma 2 2B's published shape.
DecoderLM.register_preset("gemma2-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_head=32, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="geglu_tanh", norm="rmsnorm_offset", norm_eps=1e-6, sublayer="sandwich_norm",
    bias=False, tie_embeddings=True, scale_embeddings=True, logit_softcap=30.0,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
    options={"attention": {"scale": 32 ** -0.5, "softcap": 50.0}},
    layer_options=({"attention": {"window": 8}}, {}),
))
DecoderLM.register_preset("gemma-2-2b", dict(
    vocab_size=256000, d_model=2304, n_heads=8, n_kv_heads=4, d_head=256, d_ff=9216, n_layers=26, max_len=8192,
    dropout=0.0, positional="rotary", ffn="geglu_tanh", norm="rmsnorm_offset", norm_eps=1e-6,
    sublayer="sandwich_norm", bias=False, tie_embeddings=True, scale_embeddings=True, logit_softcap=30.0,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
    options={"attention": {"scale": 256 ** -0.5, "softcap": 50.0}},
    layer_options=tuple({"attention": {"window": 4096}} if i % 2 == 0 else {} for i in range(26)),
))

# The task classes: score on the last real token, a token classifier.
register_tasks(TaskLayout("gemma2", "model.", decoder_classes("model.", None, stem="Gemma2")))
