"""T5 (``model_type: t5``) <-> ``Seq2SeqTransformer``: T5 1.0 and T5 1.1 / Flan-T5.

A T5 is a ``Seq2SeqTransformer`` with (Raffel et al. 2020, §2.1):

- bucketed relative position biases (``t5_relative``), one table per stack, stored in the first layer of each stack
  and shared by all its layers; the encoder's buckets are bidirectional, the decoder's causal (the model builds
  them so); cross-attention has no position bias;
- RMSNorm without mean subtraction or bias (``T5LayerNorm``), pre-norm sublayers and a final norm per stack;
- no biases anywhere, attention scores not scaled by ``1/sqrt(d_kv)`` (attention option ``scale=1.0``), ``d_kv``
  as the head width (``n_heads · d_kv`` need not be ``d_model``);
- one embedding matrix (``shared``) for both stacks, embeddings not scaled;
- T5 1.0: a ReLU FFN (``wi``, ``wo``) and the output projection tied to the embedding, with the decoder output
  scaled by ``d_model^-0.5`` before it (``output_scale``); T5 1.1 / Flan: ``feed_forward_proj="gated-gelu"``, a
  gelu-tanh GeGLU (``wi_0`` = gate, ``wi_1`` = up, ``wo`` = down) and an untied ``lm_head`` without the scaling.

The decoder starts from ``decoder_start_token_id``, which T5 checkpoints set to the pad id (the default here when a
config leaves it out).

Which head a checkpoint has follows the installed ``transformers`` (5.x): its ``T5Config`` always ties, reads the
output scaling from ``tie_word_embeddings`` (or the ``scale_decoder_outputs`` it writes itself), and keeps a
stored ``lm_head.weight`` that differs from ``shared.weight`` untied. The converter does the same: a checkpoint
whose ``lm_head.weight`` differs from the embedding gets an untied head, otherwise the head is tied.

Training differences (eval-mode outputs are identical): T5 also applies dropout after each stack's final norm,
which the zoo's stacks do not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from .bart import seq2seq_task_classes
from .export import register_exporter, require, tensors
from .hf_checkpoint import ACTIVATIONS, CheckpointReader, HFConfig, zoo_config
from .llama import GATED_FFNS
from .name_maps import NameMap, zoo_keys
from .registry import Converted, register_converter
from .tasks import TaskLayout, register_tasks

# T5Config's defaults in transformers 5 (fields a config.json may leave out). ``n_positions`` is not a T5Config
# field but old T5 config.json files carry it (512): it becomes the zoo's nominal ``max_len`` (relative positions
# have no limit).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": None,
    "num_heads": 8, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "is_encoder_decoder": True,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None, "decoder_start_token_id": None,
    "tie_word_embeddings": True, "n_positions": 512,
}

# T5Config.attribute_map: the generic names transformers also accepts for its fields.
ALIASES = {"d_model": "hidden_size", "num_heads": "num_attention_heads", "num_layers": "num_hidden_layers",
           "d_kv": "head_dim"}

# Non-gated zoo FFN -> T5's ``feed_forward_proj`` (an ACT2FN name), and gated zoo FFN -> ``gated-<act>``.
# ``gated-gelu`` is special-cased by T5Config to the tanh approximation (gelu_new); exact-erf GeGLU is written with
# ACT2FN's other name for the erf form, ``gelu_python``.
EXPORT_FFN = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu",
              "geglu_tanh": "gated-gelu", "swiglu": "gated-silu", "geglu": "gated-gelu_python"}

_ATTENTION = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


def _layer_names(attention_parts: Mapping[str, str], ffn_index: int, gated: bool) -> dict[str, str]:
    """Zoo module -> T5 module inside one ``T5Block`` (``layer.{i}`` lists its sublayers in order)."""
    names: dict[str, str] = {}
    for zoo_attn, (index, hf_attn) in attention_parts.items():
        names.update({f"{zoo_attn}.{z}": f"layer.{index}.{hf_attn}.{h}" for z, h in _ATTENTION.items()})
        names[f"{zoo_attn}_sublayer.norm"] = f"layer.{index}.layer_norm"
    ffn = f"layer.{ffn_index}.DenseReluDense"
    if gated:
        names.update({"ffn.gate_proj": f"{ffn}.wi_0", "ffn.up_proj": f"{ffn}.wi_1"})
    else:
        names["ffn.up_proj"] = f"{ffn}.wi"
    names.update({"ffn.down_proj": f"{ffn}.wo", "ffn_sublayer.norm": f"layer.{ffn_index}.layer_norm"})
    return names


def _stack_maps(gated: bool) -> tuple[NameMap, NameMap]:
    """The encoder's and the decoder's name maps (their blocks number the FFN sublayer differently)."""
    encoder = NameMap(
        top={"encoder_final_norm": "encoder.final_layer_norm"},
        layer=_layer_names({"self_attn": (0, "SelfAttention")}, 1, gated),
        stacks={"encoder_layers": "encoder.block.{i}"},
    )
    decoder = NameMap(
        top={"decoder_final_norm": "decoder.final_layer_norm", "src_embed": "shared", "tgt_embed": "shared",
             "lm_head": "lm_head"},
        layer=_layer_names({"self_attn": (0, "SelfAttention"), "cross_attn": (1, "EncDecAttention")}, 2, gated),
        stacks={"decoder_layers": "decoder.block.{i}"},
    )
    return encoder, decoder


def t5_name(zoo_key: str, gated: bool) -> str:
    """The ``transformers`` name of a zoo ``Seq2SeqTransformer`` tensor of a T5 model.

    Args:
        zoo_key: the zoo tensor's name.
        gated: whether the FFN is gated (T5 1.1: ``wi_0``/``wi_1``).

    Returns:
        Its ``transformers`` name.

    Raises:
        ValueError: a zoo tensor T5 has no place for.
    """
    for stack in ("encoder", "decoder"):
        # The stack's relative position table lives in the first block's self-attention.
        if zoo_key == f"{stack}_positional.relative_attention_bias":
            return f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    encoder, decoder = _stack_maps(gated)
    try:
        return encoder.to_hf(zoo_key)
    except ValueError:
        return decoder.to_hf(zoo_key)


def _ffn(cfg: HFConfig) -> str:
    """The zoo FFN computing T5's ``feed_forward_proj`` (``<act>`` or ``gated-<act>``, as T5Config parses it).

    Raises:
        ValueError: an activation (gated or not) without a zoo FFN, named.
    """
    proj = cfg["feed_forward_proj"]
    parts = proj.split("-") if isinstance(proj, str) else []
    if len(parts) == 1 and parts[0] in ACTIVATIONS:
        return ACTIVATIONS[parts[0]]
    if len(parts) == 2 and parts[0] == "gated":
        act = "gelu_new" if proj == "gated-gelu" else parts[1]  # T5Config's special case
        act = "gelu" if act == "gelu_python" else act
        if act in GATED_FFNS:
            return GATED_FFNS[act]
    supported = sorted([*ACTIVATIONS, *(f"gated-{a}" for a in (*GATED_FFNS, "gelu_python"))])
    raise cfg.unsupported("feed_forward_proj", "the feed-forward network", "the values " + ", ".join(supported))


def _decoder_scaling(cfg: HFConfig) -> bool:
    """Whether the decoder output is scaled by ``d_model^-0.5`` before the head: ``scale_decoder_outputs`` where
    transformers 5 wrote it, else ``tie_word_embeddings`` (T5 1.0: true, T5 1.1 / Flan: false)."""
    key = "scale_decoder_outputs" if "scale_decoder_outputs" in cfg.data else "tie_word_embeddings"
    value = cfg.data.get(key, DEFAULTS["tie_word_embeddings"])
    if not isinstance(value, bool):
        raise cfg.unsupported(key, "the tied head's output scaling", "true or false")
    return value


@register_converter("t5")
def convert_t5(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``T5ForConditionalGeneration`` (or ``T5Model``) checkpoint: T5 1.0 and T5 1.1 / Flan-T5.

    Args:
        hf_config: the checkpoint's ``config.json`` dict.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        A ``Seq2SeqTransformer`` config and state dict.

    Raises:
        ValueError: ``is_encoder_decoder`` false, a ``feed_forward_proj`` without a zoo FFN (e.g. ``gated-relu``),
            encoder/decoder embeddings that differ from ``shared``, or tensors missing or left over.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    cfg = HFConfig("t5", hf_config, DEFAULTS, ALIASES)
    cfg.require("is_encoder_decoder", [True], "an encoder-decoder model")
    d_model, n_heads = cfg.positive_int("d_model"), cfg.positive_int("num_heads")
    n_layers = cfg.positive_int("num_layers")
    n_decoder = n_layers if cfg["num_decoder_layers"] is None else cfg.positive_int("num_decoder_layers")
    ffn = _ffn(cfg)
    dropout = cfg.probability("dropout_rate")
    ids = cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id")
    start = cfg.token_id("decoder_start_token_id", cfg["vocab_size"])
    scaled = _decoder_scaling(cfg)

    ckpt = CheckpointReader(
        "t5", state_dict,
        # An unused table older versions saved in the decoder's first cross-attention (transformers ignores it).
        ignore=[r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"],
    )
    shared = ckpt.take_first("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if ckpt.has(copy) and not torch.equal(ckpt.take(copy), shared):
            raise ValueError(
                f"t5 checkpoint's {copy} differs from shared.weight; the zoo's T5 uses one embedding matrix for "
                "both stacks"
            )
    head = ckpt.take("lm_head.weight") if ckpt.has("lm_head.weight") else None
    tied = head is None or torch.equal(head, shared)

    config = zoo_config(
        "t5", Seq2SeqConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=n_heads, d_head=cfg.positive_int("d_kv"),
        d_ff=cfg.positive_int("d_ff"), n_encoder_layers=n_layers, n_decoder_layers=n_decoder, dropout=dropout,
        attention_dropout=dropout, max_len=cfg.positive_int("n_positions"), positional="t5_relative", ffn=ffn,
        norm="rmsnorm", norm_eps=float(cfg["layer_norm_epsilon"]), sublayer="pre_norm", bias=False,
        share_embeddings=True, tie_embeddings=tied, scale_embeddings=False, output_bias=False,
        output_scale=d_model**-0.5 if scaled else 1.0, **ids,
        decoder_start_token_id=ids["pad_token_id"] if start is None else start,
        options={
            "positional": {"num_buckets": cfg.positive_int("relative_attention_num_buckets"),
                           "max_distance": cfg.positive_int("relative_attention_max_distance")},
            "attention": {"scale": 1.0},  # T5 folds the 1/sqrt(d_kv) into its initialisation
        },
    )
    gated = ffn in GATED_FFNS.values()
    out = {"src_embed.weight": shared}
    if not tied:
        out["lm_head.weight"] = head
    for key in zoo_keys(Seq2SeqTransformer, config):
        if key not in ("src_embed.weight", "lm_head.weight"):
            out[key] = ckpt.take(t5_name(key, gated))
    ckpt.finish()
    return Converted(Seq2SeqTransformer, config, out)


@register_exporter("t5")
def export_t5(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``T5ForConditionalGeneration`` config and state dict for a T5-shaped ``Seq2SeqTransformer``.

    A tied head without the ``d_model^-0.5`` scaling is written as an untied head holding a copy of the embedding
    (``transformers`` ties equal copies again).

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not a ``Seq2SeqTransformer``, or one with parts T5 lacks (other positions, norms or
            sublayers, biases, scaled attention, GQA, separate source/target embeddings, an untied head with the
            output scaling, ...).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, Seq2SeqTransformer), f"{type(model).__name__} is not a Seq2SeqTransformer")
    c: Seq2SeqConfig = model.config
    require(c.positional == "t5_relative", f"positional={c.positional!r} (only 't5_relative')")
    require(c.norm == "rmsnorm", f"norm={c.norm!r} (only 'rmsnorm')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require(c.ffn in EXPORT_FFN, f"ffn={c.ffn!r} (one of {sorted(EXPORT_FFN)})")
    require(not c.bias and not c.output_bias, "biases (T5 has none)")
    require(c.attention == "mha" and c.n_kv_heads == c.n_heads and c.d_value == c.d_head,
            f"attention={c.attention!r} with n_kv_heads={c.n_kv_heads}, d_value={c.d_value} (only 'mha' with as "
            "many key/value heads as query heads and d_value == d_head)")
    require(c.share_embeddings, "share_embeddings=False (T5 has one embedding matrix)")
    require(not c.scale_embeddings and not c.embedding_norm and c.logit_softcap is None,
            "scaled or normalised embeddings, or logit soft-capping")
    require(c.attention_dropout == c.dropout,
            f"attention_dropout={c.attention_dropout} != dropout={c.dropout} (T5 has one dropout rate)")
    require(not c.layer_options, "per-layer options (T5's layers are all alike)")
    require(set(c.options) <= {"positional", "attention"}, f"block options {sorted(set(c.options))}")
    require(c.block_options("attention") == {"scale": 1.0},
            f"attention options {c.block_options('attention')} (T5 has exactly {{'scale': 1.0}})")
    positional = c.block_options("positional")
    require(set(positional) <= {"num_buckets", "max_distance"}, f"t5_relative options {sorted(positional)}")
    scaled = math.isclose(c.output_scale, c.d_model**-0.5, rel_tol=1e-12)
    require(scaled or c.output_scale == 1.0,
            f"output_scale={c.output_scale} (T5 scales by d_model^-0.5 = {c.d_model**-0.5:g} or not at all)")
    require(c.tie_embeddings or not scaled, "an untied head with the d_model^-0.5 output scaling")

    zoo = tensors(model)
    gated = c.ffn in GATED_FFNS.values()
    out = {"shared.weight": zoo["src_embed.weight"]}
    for key, tensor in zoo.items():
        if key not in ("src_embed.weight", "tgt_embed.weight", "lm_head.weight"):
            out[t5_name(key, gated)] = tensor
    if not scaled:  # untied, or tied without scaling: transformers reads the head from lm_head.weight
        out["lm_head.weight"] = zoo["lm_head.weight"]
    config = {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": c.vocab_size,
        "d_model": c.d_model, "d_kv": c.d_head, "d_ff": c.d_ff, "num_layers": c.n_encoder_layers,
        "num_decoder_layers": c.n_decoder_layers, "num_heads": c.n_heads,
        "relative_attention_num_buckets": positional.get("num_buckets", 32),
        "relative_attention_max_distance": positional.get("max_distance", 128),
        "dropout_rate": c.dropout, "layer_norm_epsilon": c.norm_eps, "feed_forward_proj": EXPORT_FFN[c.ffn],
        "is_encoder_decoder": True, "tie_word_embeddings": scaled, "n_positions": c.max_len,
        "pad_token_id": c.pad_token_id, "eos_token_id": c.eos_token_id, "bos_token_id": c.bos_token_id,
        "decoder_start_token_id": c.decoder_start_token_id,
    }
    return config, out


# T5ForSequenceClassification stores the model under "transformer.", T5ForQuestionAnswering at the top level
# (T5ForTokenClassification holds only the encoder: no Seq2SeqTransformer).
register_tasks(TaskLayout("t5", "", seq2seq_task_classes("T5", "transformer.", "")))


# A tiny T5 1.0 for tests (ReLU, tied and rescaled head, d_head * n_heads != d_model) and Flan-T5-small's shape.
Seq2SeqTransformer.register_preset("t5-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, d_head=12, d_ff=128, n_encoder_layers=2, n_decoder_layers=2,
    dropout=0.0, attention_dropout=0.0, max_len=512, positional="t5_relative", ffn="relu", norm="rmsnorm",
    norm_eps=1e-6, sublayer="pre_norm", bias=False, share_embeddings=True, tie_embeddings=True,
    scale_embeddings=False, output_scale=64**-0.5, pad_token_id=0, bos_token_id=None, eos_token_id=1,
    decoder_start_token_id=0,
    options={"positional": {"num_buckets": 32, "max_distance": 128}, "attention": {"scale": 1.0}},
))
Seq2SeqTransformer.register_preset("flan-t5-small", dict(
    vocab_size=32128, d_model=512, n_heads=6, d_head=64, d_ff=1024, n_encoder_layers=8, n_decoder_layers=8,
    dropout=0.1, attention_dropout=0.1, max_len=512, positional="t5_relative", ffn="geglu_tanh", norm="rmsnorm",
    norm_eps=1e-6, sublayer="pre_norm", bias=False, share_embeddings=True, tie_embeddings=False,
    scale_embeddings=False, output_scale=1.0, pad_token_id=0, bos_token_id=None, eos_token_id=1,
    decoder_start_token_id=0,
    options={"positional": {"num_buckets": 32, "max_distance": 128}, "attention": {"scale": 1.0}},
))
