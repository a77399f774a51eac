"""What Marian and BART share, in both directions: fairseq-style layer names, config fields, embedding ties.

Both families name a layer's parts ``self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``,
``encoder_attn*`` (decoder only), ``fc1``, ``fc2``, ``final_layer_norm``, use post-norm layers with
``nn.LayerNorm``'s default eps, and tie embeddings as ``transformers`` 5 does: with ``tie_word_embeddings``
every tied name reads one matrix; without it the encoder, decoder and output matrices are independent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..seq2seq import Seq2SeqConfig
from .export import activation_name, require, require_plain_attention
from .hf_checkpoint import CheckpointReader, HFConfig

# transformers' sublayer module -> zoo sublayer module, per layer.
ENCODER_LAYER = {
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn_layer_norm": "self_attn_sublayer.norm",
    "fc1": "ffn.up_proj",
    "fc2": "ffn.down_proj",
    "final_layer_norm": "ffn_sublayer.norm",
}
DECODER_LAYER = {
    **ENCODER_LAYER,
    "encoder_attn.q_proj": "cross_attn.q_proj",
    "encoder_attn.k_proj": "cross_attn.k_proj",
    "encoder_attn.v_proj": "cross_attn.v_proj",
    "encoder_attn.out_proj": "cross_attn.o_proj",
    "encoder_attn_layer_norm": "cross_attn_sublayer.norm",
}

# MarianConfig/BartConfig.attribute_map: generic names transformers accepts for their fields.
ALIASES = {"encoder_attention_heads": "num_attention_heads", "d_model": "hidden_size",
           "encoder_layers": "num_hidden_layers"}

# nn.LayerNorm's default, which both families use without a config field.
NORM_EPS = 1e-5


def common_fields(cfg: HFConfig, share_embeddings: bool) -> dict[str, object]:
    """The ``Seq2SeqConfig`` fields both families fill the same way.

    Args:
        cfg: the checkpoint's config.
        share_embeddings: whether the family shares one matrix for source and target (when tied).

    Returns:
        The fields, as keyword arguments of ``Seq2SeqConfig``.

    Raises:
        ValueError: a decoder-only config, or encoder and decoder that differ in heads or FFN width.
    """
    cfg.require("is_encoder_decoder", [True], "an encoder-decoder model")
    for enc, dec, what in (
        ("encoder_attention_heads", "decoder_attention_heads", "attention heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim", "feed-forward width"),
    ):
        if cfg.positive_int(enc) != cfg.positive_int(dec):
            raise ValueError(
                f"{cfg.model_type} checkpoint has {enc}={cfg[enc]} but {dec}={cfg[dec]}; the zoo's "
                f"Seq2SeqTransformer uses one number of {what} for both stacks"
            )
    cfg.warn_training_only("activation_dropout", 0.0, "dropout inside the feed-forward network")
    cfg.warn_training_only("encoder_layerdrop", 0.0, "LayerDrop in the encoder")
    cfg.warn_training_only("decoder_layerdrop", 0.0, "LayerDrop in the decoder")
    tie = bool(cfg["tie_word_embeddings"])
    return dict(
        vocab_size=cfg.positive_int("vocab_size"), d_model=cfg.positive_int("d_model"),
        n_heads=cfg["encoder_attention_heads"], d_ff=cfg["encoder_ffn_dim"],
        n_encoder_layers=cfg.positive_int("encoder_layers"), n_decoder_layers=cfg.positive_int("decoder_layers"),
        dropout=cfg.probability("dropout"), attention_dropout=cfg.probability("attention_dropout"),
        max_len=cfg.positive_int("max_position_embeddings"), ffn=cfg.activation("activation_function"),
        norm="layernorm", norm_eps=NORM_EPS, sublayer="post_norm", bias=True,
        share_embeddings=tie and share_embeddings, tie_embeddings=tie,
        scale_embeddings=bool(cfg["scale_embedding"]), output_bias=True,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
        decoder_start_token_id=cfg.token_id("decoder_start_token_id"),
    )


def convert_layers(ckpt: CheckpointReader, n_encoder_layers: int, n_decoder_layers: int) -> dict[str, Tensor]:
    """Every encoder and decoder layer's weights under their zoo names.

    Args:
        ckpt: the checkpoint's reader.
        n_encoder_layers: the number of encoder layers.
        n_decoder_layers: the number of decoder layers.

    Returns:
        Zoo name -> tensor.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    out: dict[str, Tensor] = {}
    for stack, n_layers, names in (("encoder", n_encoder_layers, ENCODER_LAYER),
                                   ("decoder", n_decoder_layers, DECODER_LAYER)):
        for i in range(n_layers):
            for hf, zoo in names.items():
                for p in ("weight", "bias"):
                    out[f"{stack}_layers.{i}.{zoo}.{p}"] = ckpt.take(f"{stack}.layers.{i}.{hf}.{p}")
    return out


def convert_embeddings(
    ckpt: CheckpointReader, share_embeddings: bool, tie_embeddings: bool
) -> tuple[dict[str, Tensor], frozenset[str]]:
    """Source/target embeddings and the output projection (weight and ``final_logits_bias``).

    Args:
        ckpt: the checkpoint's reader.
        share_embeddings: the zoo config's value (one matrix for source and target).
        tie_embeddings: the zoo config's value (the output projection is the target embedding).

    Returns:
        ``(zoo tensors, keys the checkpoint may lack)``; the untied output projection of a base-model
        checkpoint is the only such key.

    Shapes: embeddings ``(V, d_model)``; ``final_logits_bias`` ``(1, V)`` -> ``lm_head.bias`` ``(V,)``.
    """
    out: dict[str, Tensor] = {}
    allow_missing: frozenset[str] = frozenset()
    names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    if share_embeddings:
        out["src_embed.weight"] = ckpt.take_first(*names)
    elif tie_embeddings:
        out["src_embed.weight"] = ckpt.take("encoder.embed_tokens.weight")
        out["tgt_embed.weight"] = ckpt.take_first("decoder.embed_tokens.weight", "lm_head.weight")
    else:
        # Untied in transformers 5: three independent matrices; `shared` is then unused by the forward.
        out["src_embed.weight"] = ckpt.take_first("encoder.embed_tokens.weight", "shared.weight")
        out["tgt_embed.weight"] = ckpt.take_first("decoder.embed_tokens.weight", "shared.weight")
        if ckpt.has("lm_head.weight"):
            out["lm_head.weight"] = ckpt.take("lm_head.weight")
        else:
            allow_missing = frozenset({"lm_head.weight"})
    if ckpt.has("final_logits_bias"):
        bias = ckpt.take("final_logits_bias")  # (1, vocab) buffer
        out["lm_head.bias"] = bias.reshape(-1) if bias.dim() == 2 and bias.shape[0] == 1 else bias
    else:
        # Base-model checkpoints have none; transformers initialises the buffer to zeros.
        vocab = out.get("tgt_embed.weight", out["src_embed.weight"]).shape[0]
        out["lm_head.bias"] = torch.zeros(vocab, dtype=out["src_embed.weight"].dtype)
    return out, allow_missing


def export_fields(config: Seq2SeqConfig) -> dict[str, Any]:
    """The ``transformers`` config fields both families fill the same way from a zoo config.

    ``forced_eos_token_id`` is written as null: the zoo's generation does not force a final EOS, and the
    families' defaults would.

    Args:
        config: the zoo model's config.

    Returns:
        The ``config.json`` fields.

    Raises:
        NotExportable: a pre-norm stack, a norm eps other than ``nn.LayerNorm``'s default, attention or
            FFN shapes the families lack.
    """
    require(config.sublayer == "post_norm", f"sublayer={config.sublayer!r} (only 'post_norm')")
    require(config.norm_eps == NORM_EPS, f"norm_eps={config.norm_eps} (the family's layer norms use {NORM_EPS})")
    require_plain_attention(config)
    return {
        "vocab_size": config.vocab_size, "d_model": config.d_model, "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers, "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads, "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
        "max_position_embeddings": config.max_len, "activation_function": activation_name(config),
        "dropout": config.dropout, "attention_dropout": config.attention_dropout, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "scale_embedding": config.scale_embeddings,
        "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "decoder_start_token_id": config.decoder_start_token_id,
        "forced_eos_token_id": None, "is_encoder_decoder": True,
    }


def export_layers(zoo: Mapping[str, Tensor], config: Seq2SeqConfig) -> dict[str, Tensor]:
    """Every layer's weights and the logits bias under ``transformers`` names (``model.`` prefix).

    Args:
        zoo: the zoo model's tensors.
        config: its config.

    Returns:
        ``transformers`` name -> tensor.

    Shapes: layer tensors keep their shapes; ``lm_head.bias`` ``(V,)`` -> ``final_logits_bias`` ``(1, V)``
    (zeros without one).
    """
    out: dict[str, Tensor] = {}
    for stack, n_layers, names in (("encoder", config.n_encoder_layers, ENCODER_LAYER),
                                   ("decoder", config.n_decoder_layers, DECODER_LAYER)):
        for i in range(n_layers):
            for hf, name in names.items():
                for p in ("weight", "bias"):
                    out[f"model.{stack}.layers.{i}.{hf}.{p}"] = zoo[f"{stack}_layers.{i}.{name}.{p}"]
    bias = zoo.get("lm_head.bias")
    out["final_logits_bias"] = (
        torch.zeros(1, config.vocab_size, dtype=zoo["src_embed.weight"].dtype) if bias is None else bias[None]
    )
    return out


def export_embeddings(
    zoo: Mapping[str, Tensor], config: Seq2SeqConfig, *, has_shared_matrix: bool = True
) -> tuple[bool, dict[str, Tensor]]:
    """``(tie_word_embeddings, tensors)`` for the embeddings and the output projection.

    Fully tied zoo models (one matrix for source, target and output) map to ``tie_word_embeddings``;
    anything else is written untied, every matrix under its own name (``transformers`` 5 ties nothing
    then), with ``model.shared`` — unused by the forward — filled with the source matrix when
    ``has_shared_matrix``.

    Args:
        zoo: the zoo model's tensors.
        config: its config.
        has_shared_matrix: whether the family has ``model.shared``.

    Returns:
        ``(tie_word_embeddings, transformers name -> tensor)``.

    Shapes: each ``(V, d_model)``.
    """
    if config.share_embeddings and config.tie_embeddings:
        return True, {"model.shared.weight": zoo["src_embed.weight"]}
    out = {
        "model.encoder.embed_tokens.weight": zoo["src_embed.weight"],
        "model.decoder.embed_tokens.weight": zoo["tgt_embed.weight"],
        "lm_head.weight": zoo["lm_head.weight"],
    }
    if has_shared_matrix:
        out["model.shared.weight"] = zoo["src_embed.weight"]
    return False, out
