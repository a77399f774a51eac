"""BART (``model_type: bart``) <-> ``Seq2SeqTransformer``.

BART is a post-norm encoder-decoder with learned positions, a layer norm on the embeddings
(``layernorm_embedding``, the zoo's ``embedding_norm``) and a ``final_logits_bias`` (the zoo's
``output_bias``). Its position tables have ``max_position_embeddings + 2`` rows because position ``p`` reads
row ``p + 2`` (an offset inherited from fairseq); the zoo reads row ``p``, so the first two rows are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from .export import register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter
from .seq2seq_common import (
    ALIASES,
    common_fields,
    convert_embeddings,
    convert_layers,
    export_embeddings,
    export_fields,
    export_layers,
)
from .tasks import TaskClass, TaskLayout, dropout_field, register_tasks

# BartConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50265, "max_position_embeddings": 1024, "encoder_layers": 12, "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16, "decoder_layers": 12, "decoder_ffn_dim": 4096, "decoder_attention_heads": 16,
    "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "activation_function": "gelu", "d_model": 1024,
    "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, "scale_embedding": False,
    "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "is_encoder_decoder": True,
    "decoder_start_token_id": 2, "tie_word_embeddings": True,
}

# BART's position offset: position p reads row p + OFFSET of the table.
OFFSET = 2

# Fields older transformers versions wrote (they selected mBART-like variants); transformers 5 ignores them
# and builds plain BART, so a checkpoint asking for something else was trained as a different model.
LEGACY = {
    "normalize_before": (False, "pre-norm layers"),
    "add_final_layer_norm": (False, "a final layer norm after each stack"),
    "normalize_embedding": (True, "the layer norm on the embeddings"),
    "static_position_embeddings": (False, "sinusoidal instead of learned positions"),
    "add_bias_logits": (False, "a separate logits bias"),
    "extra_pos_embeddings": (OFFSET, "the position offset"),
}


@register_converter("bart")
def convert_bart(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``BartForConditionalGeneration`` (or ``BartModel``) checkpoint.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: encoder and decoder stacks of different shapes, legacy options the zoo lacks, an
            activation no zoo FFN computes, position tables without the two offset rows, or weights that
            do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("bart", hf_config, DEFAULTS, ALIASES)
    for key, (value, feature) in LEGACY.items():
        cfg.require_legacy(key, [value], feature)
    fields = common_fields(cfg, share_embeddings=True)
    config = zoo_config("bart", Seq2SeqConfig, **fields, positional="learned", embedding_norm=True)

    ckpt = CheckpointReader("bart", state_dict, prefix="model.")
    out = convert_layers(ckpt, config.n_encoder_layers, config.n_decoder_layers)
    embeddings, allow_missing = convert_embeddings(ckpt, config.share_embeddings, config.tie_embeddings)
    out.update(embeddings)
    for stack in ("encoder", "decoder"):
        table = ckpt.take(f"{stack}.embed_positions.weight")
        if table.dim() != 2 or table.shape[0] != config.max_len + OFFSET:
            raise ValueError(
                f"bart {stack}.embed_positions.weight must have max_position_embeddings + {OFFSET} = "
                f"{config.max_len + OFFSET} rows, got shape {tuple(table.shape)}"
            )
        out[f"{stack}_positional.weight"] = table[OFFSET:].contiguous()
        out[f"{stack}_embed_norm.weight"] = ckpt.take(f"{stack}.layernorm_embedding.weight")
        out[f"{stack}_embed_norm.bias"] = ckpt.take(f"{stack}.layernorm_embedding.bias")
    ckpt.finish()
    return Converted(Seq2SeqTransformer, config, out, allow_missing)


@register_exporter("bart")
def export_bart(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``BartForConditionalGeneration`` config and state dict for a BART-shaped ``Seq2SeqTransformer``.

    The two offset rows BART's position tables start with are never read; they are written as zeros.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not a ``Seq2SeqTransformer``, or one with parts BART lacks (non-learned positions,
            no embedding norm, pre-norm, GQA, RMSNorm, no biases, a norm eps other than 1e-5).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, Seq2SeqTransformer), f"{type(model).__name__} is not a Seq2SeqTransformer")
    c = model.config
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.embedding_norm, "embedding_norm=False (BART normalises the embeddings)")
    zoo = tensors(model)
    tie, out = export_embeddings(zoo, c)
    config = {
        "model_type": "bart", "architectures": ["BartForConditionalGeneration"], **export_fields(c),
        "tie_word_embeddings": tie,
    }
    for stack in ("encoder", "decoder"):
        table = zoo[f"{stack}_positional.weight"]
        out[f"model.{stack}.embed_positions.weight"] = torch.cat([table.new_zeros(OFFSET, c.d_model), table])
        out[f"model.{stack}.layernorm_embedding.weight"] = zoo[f"{stack}_embed_norm.weight"]
        out[f"model.{stack}.layernorm_embedding.bias"] = zoo[f"{stack}_embed_norm.bias"]
    out.update(export_layers(zoo, c))
    return config, out


def seq2seq_task_classes(stem: str, prefix: str, qa_prefix: str) -> tuple[TaskClass, ...]:
    """BART's and T5's task classes: ``classification_head`` (dropout, dense + tanh, dropout, ``out_proj``: the
    ``roberta`` pre-classifier) on the decoder state at the source's last EOS, and ``qa_outputs`` on every decoder
    state.

    Args:
        stem: the class names' start (``"Bart"``, ``"T5"``).
        prefix: where the sequence classifier stores the base model.
        qa_prefix: where the question-answering class stores it.

    Returns:
        The two task classes.
    """
    return (
        TaskClass(f"{stem}ForSequenceClassification", "sequence_classification", prefix,
                  {"classification_head.dense": "dense", "classification_head.out_proj": "classifier"},
                  lambda cfg: {"pre_classifier": "roberta", "pooling": "last",
                               "classifier_dropout": float(cfg.get("classifier_dropout") or 0.0)},
                  dropout_field("classifier_dropout"),
                  requires={"pre_classifier": "roberta", "pooling": "last", "classifier_bias": True}),
        TaskClass(f"{stem}ForQuestionAnswering", "question_answering", qa_prefix, {"qa_outputs": "classifier"},
                  requires={"pre_classifier": "none", "classifier_bias": True}),
    )


register_tasks(TaskLayout("bart", "model.", seq2seq_task_classes("Bart", "model.", "model.")))
