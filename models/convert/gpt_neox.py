"""GPT-NeoX (``model_type: gpt_neox``; Pythia, GPT-NeoX-20B) <-> ``DecoderLM``.

A GPT-NeoX is a pre-norm ``DecoderLM`` with LayerNorm, a GELU MLP with biases, rotary positions on the first
``rotary_pct`` of each head (rotary option ``fraction``) and, with ``use_parallel_residual`` (the default), the
attention and MLP side by side on the same input (``layer="parallel"``); without it the layer is sequential
(``layer="decoder"``). Its checkpoint fuses q/k/v into one ``query_key_value`` whose output rows are grouped by
head, ``(n_heads, 3, head_dim)`` (q, k, v of head 0, then of head 1, ...); the converter splits and the exporter
fuses them. The LM head is ``embed_out`` (untied by default); ``transformers`` 5 names it ``lm_head`` in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import activation_name, register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, rope_parameters, zoo_config
from .name_maps import NameMap, read_mapped, write_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# GPTNeoXConfig's defaults in transformers 5 (GPT-NeoX-20B's shape), with the older RoPE fields' defaults.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
    "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2,
    "pad_token_id": None, "tie_word_embeddings": False, "use_parallel_residual": True, "attention_bias": True,
    "rotary_pct": 0.25, "rotary_emb_base": 10000.0,
}

# Keys of the checkpoint under the "gpt_neox." prefix (stripped on reading); the fused q/k/v is handled apart.
NAMES = NameMap(
    top={"embed_tokens": "embed_in", "final_norm": "final_layer_norm"},
    layer={
        "self_attn.o_proj": "attention.dense", "ffn.up_proj": "mlp.dense_h_to_4h",
        "ffn.down_proj": "mlp.dense_4h_to_h", "self_attn_sublayer.norm": "input_layernorm",
        "ffn_sublayer.norm": "post_attention_layernorm",
    },
    stacks={"layers": "layers.{i}"},
)
QKV = ("q_proj", "k_proj", "v_proj")


def gpt_neox_rope(cfg: HFConfig) -> dict[str, Any]:
    """The zoo rotary options, read as ``GPTNeoXConfig`` does: ``rope_scaling`` (older files) or
    ``rope_parameters``, whose missing ``rope_theta``/``partial_rotary_factor`` come from ``rotary_emb_base`` and
    ``rotary_pct`` (default 0.25; a top-level ``rope_theta`` is not read by GPT-NeoX).

    Args:
        cfg: the checkpoint's config.

    Returns:
        The zoo rotary options (``base``, ``fraction``, ``scaling``).
    """
    parameters = dict(cfg.data.get("rope_scaling") or cfg.data.get("rope_parameters") or {})
    parameters.setdefault("rope_theta", cfg["rotary_emb_base"])
    parameters.setdefault("partial_rotary_factor", cfg["rotary_pct"])
    return cfg.rope_options(10000.0, parameters)


def _fields(cfg: HFConfig) -> dict[str, Any]:
    d_model, n_heads = cfg.positive_int("hidden_size"), cfg.positive_int("num_attention_heads")
    if d_model % n_heads:
        raise cfg.unsupported("hidden_size", "the model width", f"a multiple of num_attention_heads={n_heads}")
    # hidden_dropout acts on the embeddings and on both branches, as the zoo's dropout does.
    options: dict[str, dict[str, Any]] = {"positional": gpt_neox_rope(cfg)}
    if not cfg["attention_bias"]:
        options["attention"] = {"bias": False}  # the MLP keeps its biases
    return dict(
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=n_heads,
        d_ff=cfg.positive_int("intermediate_size"), n_layers=cfg.positive_int("num_hidden_layers"),
        max_len=cfg.positive_int("max_position_embeddings"), dropout=cfg.probability("hidden_dropout"),
        attention_dropout=cfg.probability("attention_dropout"), positional="rotary",
        ffn=cfg.activation("hidden_act"), norm="layernorm", norm_eps=float(cfg["layer_norm_eps"]),
        sublayer="pre_norm", layer="parallel" if cfg["use_parallel_residual"] else "decoder", bias=True,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), options=options,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
    )


def split_query_key_value(fused: Tensor, n_heads: int, d_head: int, key: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v weights (or biases) from GPT-NeoX's fused rows grouped per head.

    Args:
        fused: the ``query_key_value`` weight or bias.
        n_heads: the number of heads.
        d_head: the head width.
        key: the tensor's name (for the message).

    Returns:
        ``(q, k, v)``.

    Shapes: ``(n_heads · 3 · d_head, ...)`` -> three ``(n_heads · d_head, ...)``.

    Raises:
        ValueError: a tensor with another number of rows (named by ``key``).
    """
    if fused.shape[0] != 3 * n_heads * d_head:
        raise ValueError(f"gpt_neox {key} must have 3·hidden_size = {3 * n_heads * d_head} rows, "
                         f"got shape {tuple(fused.shape)}")
    grouped = fused.reshape(n_heads, 3, d_head, *fused.shape[1:])
    q, k, v = (grouped[:, j].reshape(n_heads * d_head, *fused.shape[1:]).contiguous() for j in range(3))
    return q, k, v


def fuse_query_key_value(q: Tensor, k: Tensor, v: Tensor, n_heads: int, d_head: int) -> Tensor:
    """Inverse of ``split_query_key_value``.

    Args:
        q: the query weight or bias.
        k: the key weight or bias.
        v: the value weight or bias.
        n_heads: the number of heads.
        d_head: the head width.

    Returns:
        The fused tensor, rows grouped per head.

    Shapes: three ``(n_heads · d_head, ...)`` -> ``(n_heads · 3 · d_head, ...)``.
    """
    rest = q.shape[1:]
    parts = [t.reshape(n_heads, 1, d_head, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * n_heads * d_head, *rest)


@register_converter("gpt_neox")
def convert_gpt_neox(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``GPTNeoXForCausalLM`` (or ``GPTNeoXModel``) checkpoint: parallel or sequential residuals,
    partial rotary, with or without attention biases, the head as ``embed_out`` or ``lm_head``.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: an activation no zoo FFN computes, a RoPE type other than default/linear/llama3, or weights
            that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("gpt_neox", hf_config, DEFAULTS)
    config = zoo_config("gpt_neox", DecoderLMConfig, **_fields(cfg))
    # attention.bias / masked_bias / rotary_emb.inv_freq: buffers older versions saved (Pythia's files hold them).
    ckpt = CheckpointReader("gpt_neox", state_dict, prefix="gpt_neox.",
                            ignore=[r"layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)"])
    n_heads, d_head = config.n_heads, config.d_head
    fused = tuple(f"layers.{i}.self_attn.{p}.{t}" for i in range(config.n_layers) for p in QKV
                  for t in ("weight", "bias"))
    out = read_mapped(ckpt, NAMES, DecoderLM, config, skip=("lm_head.weight", *fused))
    with_bias = config.block_options("attention").get("bias", config.bias)
    for i in range(config.n_layers):
        for t in ("weight", "bias") if with_bias else ("weight",):
            key = f"layers.{i}.attention.query_key_value.{t}"
            parts = split_query_key_value(ckpt.take(key), n_heads, d_head, key)
            out.update({f"layers.{i}.self_attn.{p}.{t}": w for p, w in zip(QKV, parts, strict=True)})
    allow_missing: frozenset[str] = frozenset()
    heads = ("embed_out.weight", "lm_head.weight")
    if config.tie_embeddings:
        ckpt.skip(*heads)  # the tied copy some versions save
    elif any(ckpt.has(k) for k in heads):
        out["lm_head.weight"] = ckpt.take_first(*heads)
    else:
        allow_missing = frozenset({"lm_head.weight"})  # a GPTNeoXModel checkpoint: no head
    ckpt.finish()
    return Converted(DecoderLM, config, out, allow_missing)


@register_exporter("gpt_neox")
def export_gpt_neox(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``GPTNeoXForCausalLM`` config and state dict for a GPT-NeoX-shaped ``DecoderLM`` (the head as
    ``embed_out``, as published checkpoints and ``transformers``' ``save_pretrained`` store it).

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: parts GPT-NeoX lacks (RMSNorm, GQA, gated FFNs, no MLP biases, windows, ...), named.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.positional == "rotary", f"positional={c.positional!r} (only 'rotary')")
    require(c.norm == "layernorm", f"norm={c.norm!r} (only 'layernorm')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require(c.layer in ("parallel", "decoder"), f"layer={c.layer!r} (only 'parallel' or 'decoder')")
    require(c.attention == "mha", f"attention={c.attention!r} (only 'mha')")
    require(c.n_kv_heads == c.n_heads, f"n_kv_heads={c.n_kv_heads} != n_heads={c.n_heads}")
    require(c.d_head * c.n_heads == c.d_model and c.d_value == c.d_head,
            f"d_head={c.d_head}, d_value={c.d_value} (must be d_model / n_heads)")
    require(c.bias, "bias=False (GPT-NeoX's MLP has biases)")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "scaled embeddings, logit soft-capping or an output scale")
    other = sorted(set(c.options) - {"positional", "attention"})
    require(not other and not c.layer_options, f"options for {other} or per-layer options")
    attention = c.block_options("attention")
    require(set(attention) <= {"bias"}, f"attention options {sorted(attention)}")
    rotary = c.block_options("positional")
    require(set(rotary) <= {"base", "scaling", "fraction"}, f"rotary options {sorted(rotary)}")
    rope = rope_parameters(rotary)
    rope.setdefault("partial_rotary_factor", 1.0)  # GPT-NeoX's own default is 0.25
    config: dict[str, Any] = {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff, "hidden_act": activation_name(c, ("gelu", "gelu_tanh", "relu", "silu")),
        "attention_dropout": c.attention_dropout, "hidden_dropout": c.dropout,
        "max_position_embeddings": c.max_len, "layer_norm_eps": c.norm_eps,
        "use_parallel_residual": c.layer == "parallel", "attention_bias": bool(attention.get("bias", True)),
        "tie_word_embeddings": c.tie_embeddings, "rope_parameters": rope,
        # The fields older transformers versions read.
        "rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"],
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
    }
    zoo = tensors(model)
    fused = {k for k in zoo if any(f".self_attn.{p}." in k for p in QKV)}
    out = {f"gpt_neox.{k}": v for k, v in write_mapped(zoo, NAMES, skip=("lm_head.weight", *fused)).items()}
    for i in range(c.n_layers):
        for t in ("weight", "bias"):
            parts = [zoo.get(f"layers.{i}.self_attn.{p}.{t}") for p in QKV]
            if parts[0] is not None:
                out[f"gpt_neox.layers.{i}.attention.query_key_value.{t}"] = fuse_query_key_value(
                    *parts, c.n_heads, c.d_head)
    if not c.tie_embeddings:
        out["embed_out.weight"] = zoo["lm_head.weight"]
    return config, out


# A tiny GPT-NeoX for tests (parallel residuals, a quarter of each head rotating, untied) and Pythia-160M's shape.
DecoderLM.register_preset("gpt_neox-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="gelu", norm="layernorm", norm_eps=1e-5, sublayer="pre_norm", layer="parallel",
    bias=True, tie_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=2,
    options={"positional": {"base": 10000.0, "fraction": 0.25}},
))
DecoderLM.register_preset("pythia-160m", dict(
    vocab_size=50304, d_model=768, n_heads=12, d_ff=3072, n_layers=12, max_len=2048, dropout=0.0,
    positional="rotary", ffn="gelu", norm="layernorm", norm_eps=1e-5, sublayer="pre_norm", layer="parallel",
    bias=True, tie_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=0,
    options={"positional": {"base": 10000.0, "fraction": 0.25}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("gpt_neox", "gpt_neox.", decoder_classes(
    "gpt_neox.", "gpt_neox.", token_names="classifier", stem="GPTNeoX")))
