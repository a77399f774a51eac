"""What Marian and BART checkpoints share: fairseq-style layer names, config fields and embedding ties.

Both families name a layer's parts ``self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``,
``encoder_attn*`` (decoder only), ``fc1``, ``fc2``, ``final_layer_norm``, use post-norm layers with
``nn.LayerNorm``'s default eps, and tie embeddings as ``transformers`` 5 does: with ``tie_word_embeddings``
every tied name reads one matrix; without it the encoder, decoder and output matrices are independent.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checkpoint import CheckpointReader, HFConfig

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

# nn.LayerNorm's default, which both families use without a config field.
NORM_EPS = 1e-5


def common_fields(cfg: HFConfig, share_embeddings: bool) -> dict[str, object]:
    """The ``Seq2SeqConfig`` fields both families fill the same way.

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
        pad_token_id=cfg.token_id("pad_token_id"), bos_token_id=cfg.token_id("bos_token_id"),
        eos_token_id=cfg.token_id("eos_token_id"), decoder_start_token_id=cfg.token_id("decoder_start_token_id"),
    )


def convert_layers(ckpt: CheckpointReader, n_encoder_layers: int, n_decoder_layers: int) -> dict[str, Tensor]:
    """Every encoder and decoder layer's weights under their zoo names."""
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
        share_embeddings: the zoo config's value (one matrix for source and target).
        tie_embeddings: the zoo config's value (the output projection is the target embedding).

    Returns:
        ``(zoo tensors, keys the checkpoint may lack)``; the untied output projection of a base-model
        checkpoint is the only such key.
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
