"""DistilBERT (``model_type: distilbert``) <-> ``EncoderLM``.

DistilBERT is a BERT without token-type (segment) embeddings (``type_vocab_size=0`` in the zoo): word + learned
position embeddings -> LayerNorm -> post-norm layers (``q_lin``/``k_lin``/``v_lin``/``out_lin``, ``sa_layer_norm``,
``ffn.lin1``/``ffn.lin2``, ``output_layer_norm``) -> the MLM head ``vocab_transform`` -> activation ->
``vocab_layer_norm`` -> ``vocab_projector`` (tied to the word embeddings). Every LayerNorm has eps 1e-12 (hard-coded
in ``transformers``). The head applies the encoder's activation, so a checkpoint with an MLM head loads only with the
exact GELU, the zoo head's activation.

``sinusoidal_pos_embds=True`` checkpoints store their (fixed) sinusoid table as the position-embedding weight; the
zoo loads it as a learned table, which computes the same outputs.

Positions: ``transformers`` numbers every column ``0..L-1``, padding included; the zoo counts real tokens, so the two
agree on right-padded batches (what a BERT tokenizer produces), not on left-padded ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..encoder_lm import EncoderLM, EncoderLMConfig
from .export import activation_name, register_exporter, require, require_plain_attention, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter
from .tasks import TaskClass, TaskLayout, dropout_field, register_tasks

# DistilBertConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522, "max_position_embeddings": 512, "sinusoidal_pos_embds": False, "n_layers": 6,
    "n_heads": 12, "dim": 768, "hidden_dim": 4 * 768, "dropout": 0.1, "attention_dropout": 0.1,
    "activation": "gelu", "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None, "mask_token_id": None,
    "tie_word_embeddings": True,
}
# DistilBertConfig.attribute_map: the generic names a config.json may use instead.
ALIASES = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers"}
# transformers hard-codes every DistilBERT LayerNorm's eps.
NORM_EPS = 1e-12

# transformers' layer module -> zoo layer module.
LAYER_NAMES = {
    "attention.q_lin": "self_attn.q_proj",
    "attention.k_lin": "self_attn.k_proj",
    "attention.v_lin": "self_attn.v_proj",
    "attention.out_lin": "self_attn.o_proj",
    "sa_layer_norm": "self_attn_sublayer.norm",
    "ffn.lin1": "ffn.up_proj",
    "ffn.lin2": "ffn.down_proj",
    "output_layer_norm": "ffn_sublayer.norm",
}
EMBEDDING_NAMES = {
    "embeddings.word_embeddings.weight": "embed_tokens.weight",
    "embeddings.position_embeddings.weight": "positional.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
}
HEAD_NAMES = {"vocab_transform": "mlm_head.dense", "vocab_layer_norm": "mlm_head.norm"}


@register_converter("distilbert")
def convert_distilbert(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``DistilBertForMaskedLM`` or ``DistilBertModel`` checkpoint (a ``DistilBertModel`` gets a freshly
    initialised MLM head, listed in ``allow_missing``).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: an activation no zoo FFN computes (or, with an MLM head, other than the exact GELU of the zoo's
            head), task heads the zoo lacks (classifier, QA), or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("distilbert", hf_config, DEFAULTS, aliases=ALIASES)
    n_layers = cfg.positive_int("n_layers")
    config = zoo_config(
        "distilbert", EncoderLMConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=cfg.positive_int("dim"), n_heads=cfg.positive_int("n_heads"),
        d_ff=cfg.positive_int("hidden_dim"), n_layers=n_layers, max_len=cfg.positive_int("max_position_embeddings"),
        dropout=cfg.probability("dropout"), attention_dropout=cfg.probability("attention_dropout"),
        positional="learned", ffn=cfg.activation("activation"), norm="layernorm", norm_eps=NORM_EPS,
        sublayer="post_norm", bias=True, tie_embeddings=bool(cfg["tie_word_embeddings"]), type_vocab_size=0,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"),
    )

    ckpt = CheckpointReader("distilbert", state_dict, prefix="distilbert.", ignore=[r"embeddings\.position_ids"])
    out = {zoo: ckpt.take(hf) for hf, zoo in EMBEDDING_NAMES.items()}
    for i in range(n_layers):
        for hf, zoo in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"layers.{i}.{zoo}.{p}"] = ckpt.take(f"transformer.layer.{i}.{hf}.{p}")

    allow_missing: frozenset[str] = frozenset()
    if ckpt.has_prefix("vocab_"):
        # DistilBERT's head applies the encoder's activation; the zoo's head the exact GELU.
        cfg.require("activation", ["gelu", "gelu_python"], "the activation of the MLM head's transform")
        for hf, zoo in HEAD_NAMES.items():
            for p in ("weight", "bias"):
                out[f"{zoo}.{p}"] = ckpt.take(f"{hf}.{p}")
        if config.tie_embeddings:
            ckpt.skip("vocab_projector.weight")  # the word embeddings
        else:
            out["mlm_head.decoder.weight"] = ckpt.take("vocab_projector.weight")
        out["mlm_head.decoder.bias"] = ckpt.take("vocab_projector.bias")
    else:
        head = [f"{zoo}.{p}" for zoo in (*HEAD_NAMES.values(), "mlm_head.decoder") for p in ("weight", "bias")]
        if config.tie_embeddings:
            head.remove("mlm_head.decoder.weight")  # it is the word embedding
        allow_missing = frozenset(head)
    ckpt.finish()
    return Converted(EncoderLM, config, out, allow_missing)


@register_exporter("distilbert")
def export_distilbert(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``DistilBertForMaskedLM`` config and state dict for a DistilBERT-shaped ``EncoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not an ``EncoderLM``, or one with parts DistilBERT lacks (segment embeddings, norm eps other
            than 1e-12, non-learned positions, a pre-norm stack, an FFN other than exact GELU — the MLM head shares
            the encoder's activation — GQA, RMSNorm, no biases, block options).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, EncoderLM), f"{type(model).__name__} is not an EncoderLM")
    c = model.config
    require(c.type_vocab_size == 0, f"type_vocab_size={c.type_vocab_size} (DistilBERT has no segment embeddings)")
    require(c.norm_eps == NORM_EPS, f"norm_eps={c.norm_eps} (DistilBERT's LayerNorms use {NORM_EPS})")
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.sublayer == "post_norm", f"sublayer={c.sublayer!r} (only 'post_norm')")
    require(not c.options and not c.layer_options, f"block options {c.options or c.layer_options}")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "embedding scaling, logit soft-capping or an output scale")
    require_plain_attention(c)
    config = {
        "model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"], "vocab_size": c.vocab_size,
        "dim": c.d_model, "n_layers": c.n_layers, "n_heads": c.n_heads, "hidden_dim": c.d_ff,
        "activation": activation_name(c, ("gelu",)), "dropout": c.dropout, "attention_dropout": c.attention_dropout,
        "max_position_embeddings": c.max_len, "sinusoidal_pos_embds": False, "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "mask_token_id": c.mask_token_id,
        "tie_word_embeddings": c.tie_embeddings,
    }
    zoo = tensors(model)
    out = {f"distilbert.{hf}": zoo[name] for hf, name in EMBEDDING_NAMES.items()}
    for i in range(c.n_layers):
        for hf, name in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"distilbert.transformer.layer.{i}.{hf}.{p}"] = zoo[f"layers.{i}.{name}.{p}"]
    for hf, name in HEAD_NAMES.items():
        for p in ("weight", "bias"):
            out[f"{hf}.{p}"] = zoo[f"{name}.{p}"]
    out["vocab_projector.bias"] = zoo["mlm_head.decoder.bias"]
    if not c.tie_embeddings:
        out["vocab_projector.weight"] = zoo["mlm_head.decoder.weight"]
    return config, out


# A tiny DistilBERT for tests (odd vocabulary) and distilbert-base-uncased (special ids of its BERT tokenizer).
EncoderLM.register_preset("distilbert-tiny", dict(
    vocab_size=1001, d_model=64, n_heads=4, d_ff=128, n_layers=2, max_len=128, dropout=0.1, attention_dropout=0.1,
    positional="learned", ffn="gelu", norm="layernorm", norm_eps=NORM_EPS, sublayer="post_norm", bias=True,
    tie_embeddings=True, type_vocab_size=0, pad_token_id=0, bos_token_id=None, eos_token_id=None, mask_token_id=4,
))
EncoderLM.register_preset("distilbert-base-uncased", dict(
    vocab_size=30522, d_model=768, n_heads=12, d_ff=3072, n_layers=6, max_len=512, dropout=0.1,
    attention_dropout=0.1, positional="learned", ffn="gelu", norm="layernorm", norm_eps=NORM_EPS,
    sublayer="post_norm", bias=True, tie_embeddings=True, type_vocab_size=0, pad_token_id=0, bos_token_id=101,
    eos_token_id=102, mask_token_id=103,
))

# The task classes: pre_classifier + ReLU on [CLS] (dropout seq_classif_dropout); QA with qa_dropout.
register_tasks(TaskLayout("distilbert", "distilbert.", (
    TaskClass("DistilBertForSequenceClassification", "sequence_classification", "distilbert.",
              {"pre_classifier": "dense", "classifier": "classifier"},
              lambda cfg: {"pre_classifier": "distilbert",
                           "classifier_dropout": float(cfg.get("seq_classif_dropout", 0.2))},
              dropout_field("seq_classif_dropout"),
              requires={"pre_classifier": "distilbert", "pooling": "cls", "classifier_bias": True}),
    TaskClass("DistilBertForTokenClassification", "token_classification", "distilbert.", {"classifier": "classifier"},
              requires={"pre_classifier": "none", "classifier_dropout": None, "classifier_bias": True}),
    TaskClass("DistilBertForQuestionAnswering", "question_answering", "distilbert.", {"qa_outputs": "classifier"},
              lambda cfg: {"classifier_dropout": float(cfg.get("qa_dropout", 0.1))}, dropout_field("qa_dropout"),
              requires={"pre_classifier": "none", "classifier_bias": True}),
)))
