"""RoBERTa (``model_type: roberta``) <-> ``EncoderLM``.

RoBERTa is BERT's architecture (the same layer names, so ``bert.LAYER_NAMES`` serves both) with three differences:
the weights sit under ``roberta.``, the MLM head is ``lm_head.{dense,layer_norm,decoder,bias}`` and always applies
the exact GELU, and positions are fairseq's: a token's position is ``padding_idx + 1 +`` the number of real tokens
before it, where ``padding_idx`` is ``pad_token_id`` and "real" means ``input_id != pad_token_id``. Pad tokens take
the row ``padding_idx``.

The zoo counts real-token positions from 0 (from the attention mask), so its position table is rows
``padding_idx + 1:`` of RoBERTa's and ``max_len = max_position_embeddings - padding_idx - 1`` (514 - 2 = 512 for
``roberta-base``). Both agree wherever the attention mask marks exactly the pad tokens, which is what a tokenizer
produces; positions of the padding itself never reach a real token's output. The exporter gives back the
``padding_idx + 1`` leading rows as zeros (RoBERTa never reads the rows below ``padding_idx``, and reads row
``padding_idx`` only for pad tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..encoder_lm import EncoderLM, EncoderLMConfig
from .bert import LAYER_NAMES, layer_norm_modern_name
from .export import activation_name, register_exporter, require, require_plain_attention, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter
from .tasks import TaskClass, TaskLayout, register_tasks

# RobertaConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "is_decoder": False,
    "add_cross_attention": False, "tie_word_embeddings": True, "position_embedding_type": "absolute",
    "mask_token_id": None,  # RobertaConfig has no such field; a config.json may still carry one
}

# RoBERTa's MLM head (transformers name -> zoo name).
HEAD_NAMES = {"lm_head.dense": "mlm_head.dense", "lm_head.layer_norm": "mlm_head.norm"}


@register_converter("roberta")
def convert_roberta(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``RobertaForMaskedLM`` or ``RobertaModel`` checkpoint (a ``RobertaModel`` gets a freshly initialised
    MLM head, listed in ``allow_missing``; its pooler is left out with a warning).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: relative position embeddings (older configs' ``position_embedding_type``), a causal or
            cross-attending RoBERTa (``RobertaForCausalLM``), no ``pad_token_id`` (RoBERTa's positions are counted
            from it) or one leaving no position rows, an activation no zoo FFN computes, task heads the zoo lacks,
            or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("roberta", hf_config, DEFAULTS)
    cfg.require_legacy("position_embedding_type", ["absolute"], "relative position embeddings in attention")
    cfg.require("is_decoder", [False], "causal self-attention")
    cfg.require("add_cross_attention", [False], "cross-attention layers")
    n_layers = cfg.positive_int("num_hidden_layers")
    n_positions = cfg.positive_int("max_position_embeddings")
    pad = cfg["pad_token_id"]
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < n_positions - 1:
        raise ValueError(
            f"roberta checkpoint has pad_token_id={pad!r}; RoBERTa counts positions from it, so it must be an integer "
            f"in [0, max_position_embeddings - 1 = {n_positions - 1})"
        )
    type_vocab_size = cfg["type_vocab_size"]
    if isinstance(type_vocab_size, bool) or not isinstance(type_vocab_size, int) or type_vocab_size < 0:
        raise ValueError(f"roberta config field type_vocab_size must be an integer >= 0, got {type_vocab_size!r}")
    config = zoo_config(
        "roberta", EncoderLMConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=cfg.positive_int("hidden_size"),
        n_heads=cfg.positive_int("num_attention_heads"), d_ff=cfg.positive_int("intermediate_size"),
        n_layers=n_layers, max_len=n_positions - pad - 1,
        dropout=cfg.probability("hidden_dropout_prob"),
        attention_dropout=cfg.probability("attention_probs_dropout_prob"),
        positional="learned", ffn=cfg.activation("hidden_act"), norm="layernorm",
        norm_eps=float(cfg["layer_norm_eps"]), sublayer="post_norm", bias=True,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), type_vocab_size=type_vocab_size,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"),
    )

    renamed = {layer_norm_modern_name(k): v for k, v in state_dict.items()}
    ckpt = CheckpointReader(
        "roberta", renamed, prefix="roberta.", ignore=[r"embeddings\.(position_ids|token_type_ids)"]
    )
    ckpt.drop(r"pooler\..*", "the pooler (RobertaModel's <s> projection)")
    out: dict[str, Tensor] = {
        "embed_tokens.weight": ckpt.take("embeddings.word_embeddings.weight"),
        # fairseq positions start after the padding row (see the module docstring).
        "positional.weight": ckpt.take("embeddings.position_embeddings.weight")[pad + 1:],
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
    if ckpt.has_prefix("lm_head."):
        for hf, zoo in HEAD_NAMES.items():
            for p in ("weight", "bias"):
                out[f"{zoo}.{p}"] = ckpt.take(f"{hf}.{p}")
        if config.tie_embeddings:
            # transformers ties decoder.weight to the word embeddings and decoder.bias to lm_head.bias.
            ckpt.skip("lm_head.decoder.weight")
            out["mlm_head.decoder.bias"] = ckpt.take_first("lm_head.bias", "lm_head.decoder.bias")
        else:
            # Untied, the head reads decoder.bias; lm_head.bias is an unused parameter.
            out["mlm_head.decoder.weight"] = ckpt.take("lm_head.decoder.weight")
            out["mlm_head.decoder.bias"] = ckpt.take_first("lm_head.decoder.bias", "lm_head.bias")
    else:
        head = [f"{zoo}.{p}" for zoo in (*HEAD_NAMES.values(), "mlm_head.decoder") for p in ("weight", "bias")]
        if config.tie_embeddings:
            head.remove("mlm_head.decoder.weight")  # it is the word embedding
        allow_missing = frozenset(head)
    ckpt.finish()
    return Converted(EncoderLM, config, out, allow_missing)


@register_exporter("roberta")
def export_roberta(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``RobertaForMaskedLM`` config and state dict for a RoBERTa-shaped ``EncoderLM``.

    The position table gets ``pad_token_id + 1`` leading zero rows (RoBERTa's positions start after the padding
    row); a model without segment embeddings gets one all-zero segment embedding, which adds nothing.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not an ``EncoderLM``, no ``pad_token_id`` (RoBERTa counts positions from it), or parts
            RoBERTa lacks (non-learned positions, a pre-norm stack, GQA, RMSNorm, no biases, an FFN activation
            other than GELU/ReLU/SiLU, block options).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, EncoderLM), f"{type(model).__name__} is not an EncoderLM")
    c = model.config
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.sublayer == "post_norm", f"sublayer={c.sublayer!r} (only 'post_norm')")
    require(c.pad_token_id is not None, "pad_token_id=None (RoBERTa numbers positions from the padding id)")
    require(not c.options and not c.layer_options, f"block options {c.options or c.layer_options}")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "embedding scaling, logit soft-capping or an output scale")
    require_plain_attention(c)
    pad = c.pad_token_id
    config = {
        "model_type": "roberta", "architectures": ["RobertaForMaskedLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff, "hidden_act": activation_name(c),
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attention_dropout,
        "max_position_embeddings": c.max_len + pad + 1, "type_vocab_size": max(c.type_vocab_size, 1),
        "layer_norm_eps": c.norm_eps, "pad_token_id": pad, "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id, "mask_token_id": c.mask_token_id, "tie_word_embeddings": c.tie_embeddings,
    }
    zoo = tensors(model)
    positions = zoo["positional.weight"]
    segments = zoo.get("token_type_embed.weight")
    out = {
        "roberta.embeddings.word_embeddings.weight": zoo["embed_tokens.weight"],
        "roberta.embeddings.position_embeddings.weight": torch.cat(
            [positions.new_zeros(pad + 1, c.d_model), positions]
        ),
        "roberta.embeddings.token_type_embeddings.weight": (
            positions.new_zeros(1, c.d_model) if segments is None else segments
        ),
        "roberta.embeddings.LayerNorm.weight": zoo["embed_norm.weight"],
        "roberta.embeddings.LayerNorm.bias": zoo["embed_norm.bias"],
    }
    for i in range(c.n_layers):
        for hf, name in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"roberta.encoder.layer.{i}.{hf}.{p}"] = zoo[f"layers.{i}.{name}.{p}"]
    for hf, name in HEAD_NAMES.items():
        for p in ("weight", "bias"):
            out[f"{hf}.{p}"] = zoo[f"{name}.{p}"]
    out["lm_head.bias"] = zoo["mlm_head.decoder.bias"]
    if not c.tie_embeddings:
        out["lm_head.decoder.weight"] = zoo["mlm_head.decoder.weight"]
        out["lm_head.decoder.bias"] = zoo["mlm_head.decoder.bias"]
    return config, out


# A tiny RoBERTa for tests (odd vocabulary; 2 + 64 position rows as in the published 514 = 2 + 512) and roberta-base.
EncoderLM.register_preset("roberta-tiny", dict(
    vocab_size=1001, d_model=64, n_heads=4, d_ff=128, n_layers=2, max_len=64, dropout=0.1, attention_dropout=0.1,
    positional="learned", ffn="gelu", norm="layernorm", norm_eps=1e-5, sublayer="post_norm", bias=True,
    tie_embeddings=True, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, mask_token_id=4,
))
EncoderLM.register_preset("roberta-base", dict(
    vocab_size=50265, d_model=768, n_heads=12, d_ff=3072, n_layers=12, max_len=512, dropout=0.1,
    attention_dropout=0.1, positional="learned", ffn="gelu", norm="layernorm", norm_eps=1e-5, sublayer="post_norm",
    bias=True, tie_embeddings=True, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    mask_token_id=50264,
))

# The task classes: RoBERTa's classification head is dropout, dense + tanh on <s>, dropout, out_proj.
register_tasks(TaskLayout("roberta", "roberta.", (
    TaskClass("RobertaForSequenceClassification", "sequence_classification", "roberta.",
              {"classifier.dense": "dense", "classifier.out_proj": "classifier"},
              lambda cfg: {"pre_classifier": "roberta", "classifier_dropout": cfg.get("classifier_dropout")},
              lambda options, config: {"classifier_dropout": options.get("classifier_dropout")},
              requires={"pre_classifier": "roberta", "pooling": "cls", "classifier_bias": True}),
    TaskClass("RobertaForTokenClassification", "token_classification", "roberta.", {"classifier": "classifier"},
              lambda cfg: {"classifier_dropout": cfg.get("classifier_dropout")},
              lambda options, config: {"classifier_dropout": options.get("classifier_dropout")},
              requires={"pre_classifier": "none", "classifier_bias": True}),
    TaskClass("RobertaForQuestionAnswering", "question_answering", "roberta.", {"qa_outputs": "classifier"},
              requires={"pre_classifier": "none", "classifier_bias": True}),
)))
