"""Marian (``model_type: marian``) <-> ``Seq2SeqTransformer``.

MarianMT is the paper's post-norm encoder-decoder with sinusoids in the ``[sin | cos]`` layout (the
zoo's ``sinusoidal_concat``), embeddings optionally scaled by sqrt(d_model), no embedding norm, and a
``final_logits_bias`` added to the logits (the zoo's ``output_bias``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from blocks.positional import sinusoid_table

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

# MarianConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101, "decoder_vocab_size": None, "max_position_embeddings": 1024, "encoder_layers": 12,
    "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12, "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "is_encoder_decoder": True,
    "activation_function": "gelu", "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "decoder_start_token_id": 58100, "scale_embedding": False, "pad_token_id": 58100,
    "eos_token_id": 0, "bos_token_id": None, "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
}

# Fields older transformers versions wrote (BART-era options); Marian checkpoints must carry these values.
LEGACY = {
    "normalize_before": (False, "pre-norm layers"),
    "add_final_layer_norm": (False, "a final layer norm after each stack"),
    "normalize_embedding": (False, "a layer norm on the embeddings"),
    "static_position_embeddings": (True, "learned instead of sinusoidal positions"),
    "add_bias_logits": (False, "a separate logits bias"),
}

# Tolerance for comparing a checkpoint's (frozen, recomputable) sinusoid table with the zoo's.
TABLE_ATOL = 1e-5


@register_converter("marian")
def convert_marian(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``MarianMTModel`` (or ``MarianModel``) checkpoint.

    Position tables are not stored by recent ``transformers`` (they are recomputed); when a checkpoint
    holds them they must equal the ``[sin | cos]`` sinusoids.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: a decoder vocabulary different from the encoder's, encoder and decoder stacks of
            different shapes, legacy options the zoo lacks, an activation no zoo FFN computes, stored
            position tables that are not the sinusoids, or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("marian", hf_config, DEFAULTS, ALIASES)
    for key, (value, feature) in LEGACY.items():
        cfg.require_legacy(key, [value], feature)
    if cfg["decoder_vocab_size"] is not None and cfg["decoder_vocab_size"] != cfg["vocab_size"]:
        raise ValueError(
            f"marian checkpoint has decoder_vocab_size={cfg['decoder_vocab_size']} != vocab_size="
            f"{cfg['vocab_size']}; the zoo's Seq2SeqTransformer has one vocabulary for both sides"
        )
    fields = common_fields(cfg, share_embeddings=bool(cfg["share_encoder_decoder_embeddings"]))
    config = zoo_config(
        "marian", Seq2SeqConfig, **fields, positional="sinusoidal_concat", embedding_norm=False
    )

    ckpt = CheckpointReader("marian", state_dict, prefix="model.")
    out = convert_layers(ckpt, config.n_encoder_layers, config.n_decoder_layers)
    embeddings, allow_missing = convert_embeddings(ckpt, config.share_embeddings, config.tie_embeddings)
    out.update(embeddings)
    for stack in ("encoder", "decoder"):
        key = f"{stack}.embed_positions.weight"
        if ckpt.has(key):
            _check_sinusoids(ckpt.take(key), key)
    ckpt.finish()
    return Converted(Seq2SeqTransformer, config, out, allow_missing)


def _check_sinusoids(table: Tensor, key: str) -> None:
    if table.dim() != 2:
        raise ValueError(f"marian {key} must be a (positions, d_model) table, got shape {tuple(table.shape)}")
    expected = sinusoid_table(table.shape[0], table.shape[1], layout="concat")
    if not torch.allclose(table.float(), expected, atol=TABLE_ATOL):
        raise ValueError(
            f"marian {key} differs from the [sin | cos] sinusoids (max difference "
            f"{(table.float() - expected).abs().max().item():.3g}); the zoo recomputes them and cannot load "
            "trained or altered position tables"
        )


@register_exporter("marian")
def export_marian(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``MarianMTModel`` config and state dict for a Marian-shaped ``Seq2SeqTransformer``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not a ``Seq2SeqTransformer``, or one with parts Marian lacks (positions other than
            ``sinusoidal_concat``, an embedding norm, pre-norm, GQA, RMSNorm, no biases, a norm eps
            other than 1e-5).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, Seq2SeqTransformer), f"{type(model).__name__} is not a Seq2SeqTransformer")
    c = model.config
    require(c.positional == "sinusoidal_concat", f"positional={c.positional!r} (only 'sinusoidal_concat')")
    require(not c.embedding_norm, "embedding_norm=True (Marian has no norm on the embeddings)")
    zoo = tensors(model)
    tie, out = export_embeddings(zoo, c, has_shared_matrix=False)
    config = {
        "model_type": "marian", "architectures": ["MarianMTModel"], **export_fields(c),
        "decoder_vocab_size": c.vocab_size, "share_encoder_decoder_embeddings": tie, "tie_word_embeddings": tie,
    }
    out.update(export_layers(zoo, c))
    return config, out
