"""BERT (``model_type: bert``) <-> ``EncoderLM``.

A ``BertForMaskedLM`` checkpoint maps one to one (token, position and token-type embeddings, post-norm
layers, the MLM head). A ``BertModel`` checkpoint has no MLM head: the converter lists the head's keys in
``allow_missing`` and a loader initialises them with a warning. The pooler and the next-sentence head of
``BertModel``/``BertForPreTraining`` checkpoints have no zoo counterpart and are left out with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..encoder_lm import EncoderLM, EncoderLMConfig
from .export import activation_name, register_exporter, require, require_plain_attention, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter
from .tasks import TaskClass, TaskLayout, register_tasks

# BertConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "pad_token_id": 0, "is_decoder": False, "add_cross_attention": False,
    "bos_token_id": None, "eos_token_id": None, "mask_token_id": None, "tie_word_embeddings": True,
    "position_embedding_type": "absolute",
}

# transformers' layer module -> zoo layer module.
LAYER_NAMES = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.o_proj",
    "attention.output.LayerNorm": "self_attn_sublayer.norm",
    "intermediate.dense": "ffn.up_proj",
    "output.dense": "ffn.down_proj",
    "output.LayerNorm": "ffn_sublayer.norm",
}
HEAD_NAMES = {
    "cls.predictions.transform.dense": "mlm_head.dense",
    "cls.predictions.transform.LayerNorm": "mlm_head.norm",
}


@register_converter("bert")
def convert_bert(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``BertForMaskedLM``, ``BertForPreTraining`` or ``BertModel`` checkpoint.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: ``position_embedding_type`` other than ``"absolute"``, a causal (``is_decoder``) or
            cross-attending BERT, an activation no zoo FFN computes (or, with an MLM head, other than the
            exact GELU of the zoo's head), task heads the zoo lacks, or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("bert", hf_config, DEFAULTS)
    cfg.require("position_embedding_type", ["absolute"], "relative position embeddings in attention")
    cfg.require("is_decoder", [False], "causal self-attention")
    cfg.require("add_cross_attention", [False], "cross-attention layers")
    n_layers = cfg.positive_int("num_hidden_layers")
    type_vocab_size = cfg["type_vocab_size"]
    if isinstance(type_vocab_size, bool) or not isinstance(type_vocab_size, int) or type_vocab_size < 0:
        raise ValueError(f"bert config field type_vocab_size must be an integer >= 0, got {type_vocab_size!r}")
    config = zoo_config(
        "bert", EncoderLMConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=cfg.positive_int("hidden_size"),
        n_heads=cfg.positive_int("num_attention_heads"), d_ff=cfg.positive_int("intermediate_size"),
        n_layers=n_layers, max_len=cfg.positive_int("max_position_embeddings"),
        dropout=cfg.probability("hidden_dropout_prob"),
        attention_dropout=cfg.probability("attention_probs_dropout_prob"),
        positional="learned", ffn=cfg.activation("hidden_act"), norm="layernorm",
        norm_eps=float(cfg["layer_norm_eps"]), sublayer="post_norm", bias=True,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), type_vocab_size=type_vocab_size,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"),
    )

    # The original TF checkpoints name LayerNorm parameters gamma/beta; transformers renames them on load.
    renamed = {layer_norm_modern_name(k): v for k, v in state_dict.items()}
    # embeddings.position_ids / token_type_ids are index buffers some versions saved.
    ckpt = CheckpointReader("bert", renamed, prefix="bert.", ignore=[r"embeddings\.(position_ids|token_type_ids)"])
    ckpt.drop(r"pooler\..*", "the pooler (BertModel's [CLS] projection)")
    ckpt.drop(r"cls\.seq_relationship\..*", "the next-sentence-prediction head")
    out: dict[str, Tensor] = {
        "embed_tokens.weight": ckpt.take("embeddings.word_embeddings.weight"),
        "positional.weight": ckpt.take("embeddings.position_embeddings.weight"),
        "embed_norm.weight": ckpt.take("embeddings.LayerNorm.weight"),
        "embed_norm.bias": ckpt.take("embeddings.LayerNorm.bias"),
    }
    if type_vocab_size:
        out["token_type_embed.weight"] = ckpt.take("embeddings.token_type_embeddings.weight")
    for i in range(n_layers):
        for hf, zoo in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"layers.{i}.{zoo}.{p}"] = ckpt.take(f"encoder.layer.{i}.{hf}.{p}")

    allow_missing: frozenset[str] = frozenset()
    if ckpt.has_prefix("cls.predictions."):
        # The zoo's MLM head applies the exact GELU whatever the encoder's activation.
        cfg.require("hidden_act", ["gelu", "gelu_python"], "the activation of the MLM head's transform")
        for hf, zoo in HEAD_NAMES.items():
            for p in ("weight", "bias"):
                out[f"{zoo}.{p}"] = ckpt.take(f"{hf}.{p}")
        if config.tie_embeddings:
            # transformers ties decoder.weight to the word embeddings and decoder.bias to predictions.bias.
            ckpt.skip("cls.predictions.decoder.weight")
            out["mlm_head.decoder.bias"] = ckpt.take_first("cls.predictions.bias", "cls.predictions.decoder.bias")
        else:
            # Untied, the head reads decoder.bias; predictions.bias is an unused parameter.
            out["mlm_head.decoder.weight"] = ckpt.take("cls.predictions.decoder.weight")
            out["mlm_head.decoder.bias"] = ckpt.take_first("cls.predictions.decoder.bias", "cls.predictions.bias")
    else:
        head = [f"{zoo}.{p}" for zoo in (*HEAD_NAMES.values(), "mlm_head.decoder") for p in ("weight", "bias")]
        if config.tie_embeddings:
            head.remove("mlm_head.decoder.weight")  # it is the word embedding
        allow_missing = frozenset(head)
    ckpt.finish()
    return Converted(EncoderLM, config, out, allow_missing)


def layer_norm_modern_name(key: str) -> str:
    """A TF-era BERT tensor name with `LayerNorm.gamma`/`beta` as `transformers` names it (`weight`/`bias`).

    Args:
        key: a tensor name.

    Returns:
        The name, renamed when it ends in ``LayerNorm.gamma`` or ``LayerNorm.beta``.
    """
    if key.endswith("LayerNorm.gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith("LayerNorm.beta"):
        return key[: -len("beta")] + "bias"
    return key


@register_exporter("bert")
def export_bert(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``BertForMaskedLM`` config and state dict for a BERT-shaped ``EncoderLM``.

    A model without segment embeddings (``type_vocab_size=0``) gets one all-zero segment embedding,
    which adds nothing, because ``BertModel`` always has the table.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not an ``EncoderLM``, or one with parts BERT lacks (non-learned positions, a
            pre-norm stack, an FFN other than exact GELU — BERT's MLM head shares the encoder's activation —
            GQA, RMSNorm, no biases).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, EncoderLM), f"{type(model).__name__} is not an EncoderLM")
    c = model.config
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.sublayer == "post_norm", f"sublayer={c.sublayer!r} (only 'post_norm')")
    require_plain_attention(c)
    config = {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff, "hidden_act": activation_name(c, ("gelu",)),
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attention_dropout,
        "max_position_embeddings": c.max_len, "type_vocab_size": max(c.type_vocab_size, 1),
        "layer_norm_eps": c.norm_eps, "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id, "mask_token_id": c.mask_token_id, "tie_word_embeddings": c.tie_embeddings,
    }
    zoo = tensors(model)
    segments = zoo.get("token_type_embed.weight")
    out = {
        "bert.embeddings.word_embeddings.weight": zoo["embed_tokens.weight"],
        "bert.embeddings.position_embeddings.weight": zoo["positional.weight"],
        "bert.embeddings.token_type_embeddings.weight": (
            torch.zeros(1, c.d_model, dtype=zoo["embed_tokens.weight"].dtype) if segments is None else segments
        ),
        "bert.embeddings.LayerNorm.weight": zoo["embed_norm.weight"],
        "bert.embeddings.LayerNorm.bias": zoo["embed_norm.bias"],
    }
    for i in range(c.n_layers):
        for hf, name in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"bert.encoder.layer.{i}.{hf}.{p}"] = zoo[f"layers.{i}.{name}.{p}"]
    for hf, name in HEAD_NAMES.items():
        for p in ("weight", "bias"):
            out[f"{hf}.{p}"] = zoo[f"{name}.{p}"]
    out["cls.predictions.bias"] = zoo["mlm_head.decoder.bias"]
    if not c.tie_embeddings:
        out["cls.predictions.decoder.weight"] = zoo["mlm_head.decoder.weight"]
        out["cls.predictions.decoder.bias"] = zoo["mlm_head.decoder.bias"]
    return config, out


# The published size (the tiny test size is EncoderLM's own "tiny" preset).
EncoderLM.register_preset("bert-base", dict(
    vocab_size=30522, d_model=768, n_heads=12, d_ff=3072, n_layers=12, max_len=512, dropout=0.1,
    attention_dropout=0.1, ffn="gelu", norm_eps=1e-12, type_vocab_size=2, pad_token_id=0,
    bos_token_id=101, eos_token_id=102, mask_token_id=103,
))

# The task classes: BERT's pooler (dense + tanh on [CLS]) before the sequence classifier.
register_tasks(TaskLayout("bert", "bert.", (
    TaskClass("BertForSequenceClassification", "sequence_classification", "bert.",
              {"bert.pooler.dense": "dense", "classifier": "classifier"},
              lambda cfg: {"pre_classifier": "bert", "classifier_dropout": cfg.get("classifier_dropout")},
              lambda options, config: {"classifier_dropout": options.get("classifier_dropout")},
              requires={"pre_classifier": "bert", "pooling": "cls", "classifier_bias": True}),
    TaskClass("BertForTokenClassification", "token_classification", "bert.", {"classifier": "classifier"},
              lambda cfg: {"classifier_dropout": cfg.get("classifier_dropout")},
              lambda options, config: {"classifier_dropout": options.get("classifier_dropout")},
              requires={"pre_classifier": "none", "classifier_bias": True}),
    TaskClass("BertForQuestionAnswering", "question_answering", "bert.", {"qa_outputs": "classifier"},
              requires={"pre_classifier": "none", "classifier_bias": True}),
)))
