"""ViT (``model_type: vit``) <-> ``VisionTransformer``.

A ``ViTForImageClassification`` checkpoint maps one to one: patch projection, class token, position table,
pre-norm layers, final LayerNorm and classifier. ``transformers`` keeps a batch axis on the class token and
the position table (``(1, 1 + N, D)``); the zoo's table is ``(1 + N, D)``. A ``ViTModel`` checkpoint (no
``vit.`` prefix) has no classifier: the converter lists it in ``allow_missing``, and its pooler, which a
classifier on the class token does not use, is left out with a warning.

State dicts come in two spellings: the one on disk (``encoder.layer.{i}.attention.attention.query``, as on the
Hub and as ``save_pretrained`` writes) and the in-memory one of ``transformers`` 5 (``layers.{i}.attention.q_proj``,
from ``model.state_dict()``); both are read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..vit import VisionTransformer, VisionTransformerConfig
from .export import activation_name, register_exporter, require, require_plain_attention, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter

# ViTConfig's defaults in transformers 5 (fields a config.json may leave out); 2 labels is PreTrainedConfig's.
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    "layer_norm_eps": 1e-12, "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": True,
    "head_dim": None, "id2label": None, "num_labels": 2,
}

# transformers' layer module (on-disk names) -> zoo layer module.
LAYER_NAMES = {
    "attention.attention.query": "self_attn.q_proj",
    "attention.attention.key": "self_attn.k_proj",
    "attention.attention.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.o_proj",
    "layernorm_before": "self_attn_sublayer.norm",
    "intermediate.dense": "ffn.up_proj",
    "output.dense": "ffn.down_proj",
    "layernorm_after": "ffn_sublayer.norm",
}
EMBEDDING_NAMES = {
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "final_norm",
}
CLASSIFIER = ("classifier.weight", "classifier.bias")

# transformers 5's in-memory layer names -> the on-disk ones (the inverse of its load-time renaming).
_IN_MEMORY_LAYER = re.compile(r"((?:vit\.)?)layers\.(\d+)\.(.*)")
_IN_MEMORY_NAMES = {
    "attention.q_proj": "attention.attention.query",
    "attention.k_proj": "attention.attention.key",
    "attention.v_proj": "attention.attention.value",
    "attention.o_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


@register_converter("vit")
def convert_vit(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``ViTForImageClassification`` or ``ViTModel`` checkpoint.

    ``num_labels`` is the number of entries of ``id2label`` (``transformers``' rule; 2 without one).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: non-square images or patches, ``qkv_bias=False``, an activation no zoo FFN computes,
            parts of other ViT task models (a mask token, an image decoder), or weights that do not fit
            the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("vit", hf_config, DEFAULTS)
    cfg.require("qkv_bias", [True], "query/key/value projections without biases")
    n_layers = cfg.positive_int("num_hidden_layers")
    id2label = cfg["id2label"]
    num_labels = len(id2label) if id2label else cfg["num_labels"]
    config = zoo_config(
        "vit", VisionTransformerConfig,
        image_size=_square(cfg, "image_size"), patch_size=_square(cfg, "patch_size"),
        num_channels=cfg.positive_int("num_channels"), d_model=cfg.positive_int("hidden_size"),
        n_layers=n_layers, n_heads=cfg.positive_int("num_attention_heads"),
        d_head=None if cfg["head_dim"] is None else cfg.positive_int("head_dim"),
        d_ff=cfg.positive_int("intermediate_size"), dropout=cfg.probability("hidden_dropout_prob"),
        attention_dropout=cfg.probability("attention_probs_dropout_prob"), norm="layernorm",
        norm_eps=float(cfg["layer_norm_eps"]), ffn=cfg.activation("hidden_act"), sublayer="pre_norm",
        num_labels=num_labels, pooling="cls", positional="learned", patch_embedding="conv", bias=True,
    )

    ckpt = CheckpointReader("vit", {_on_disk_name(k): v for k, v in state_dict.items()}, prefix="vit.")
    ckpt.drop(r"pooler\..*", "the pooler (ViTModel's dense + tanh over the class token)")
    out: dict[str, Tensor] = {
        "cls_token": ckpt.take("embeddings.cls_token"),
        "positional.weight": _drop_batch_axis(ckpt.take("embeddings.position_embeddings")),
    }
    for hf, zoo in EMBEDDING_NAMES.items():
        for p in ("weight", "bias"):
            out[f"{zoo}.{p}"] = ckpt.take(f"{hf}.{p}")
    for i in range(n_layers):
        for hf, zoo in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"layers.{i}.{zoo}.{p}"] = ckpt.take(f"encoder.layer.{i}.{hf}.{p}")
    allow_missing: frozenset[str] = frozenset()
    if ckpt.has("classifier.weight"):
        out.update({key: ckpt.take(key) for key in CLASSIFIER})
    else:
        allow_missing = frozenset(CLASSIFIER)
    ckpt.finish()
    return Converted(VisionTransformer, config, out, allow_missing)


@register_exporter("vit")
def export_vit(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``ViTForImageClassification`` config and state dict for a ViT-shaped ``VisionTransformer``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not a ``VisionTransformer``, or one with parts ViT lacks (mean pooling, no or other
            position embeddings, post-norm layers, another patch embedding, GQA, RMSNorm, no biases, an FFN
            other than GELU/ReLU/SiLU).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, VisionTransformer), f"{type(model).__name__} is not a VisionTransformer")
    c = model.config
    require(c.pooling == "cls", f"pooling={c.pooling!r} (only 'cls')")
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require(c.patch_embedding == "conv", f"patch_embedding={c.patch_embedding!r} (only 'conv')")
    require_plain_attention(c)
    labels = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
    config = {
        "model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff,
        "hidden_act": activation_name(c, ("gelu", "gelu_tanh", "relu", "silu")),
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attention_dropout,
        "layer_norm_eps": c.norm_eps, "image_size": c.image_size, "patch_size": c.patch_size,
        "num_channels": c.num_channels, "qkv_bias": True, "id2label": labels,
        "label2id": {name: int(i) for i, name in labels.items()},
    }
    zoo = tensors(model)
    out = {
        "vit.embeddings.cls_token": zoo["cls_token"],
        "vit.embeddings.position_embeddings": zoo["positional.weight"][None],  # (1, 1 + N, D)
    }
    for hf, name in EMBEDDING_NAMES.items():
        for p in ("weight", "bias"):
            out[f"vit.{hf}.{p}"] = zoo[f"{name}.{p}"]
    for i in range(c.n_layers):
        for hf, name in LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"vit.encoder.layer.{i}.{hf}.{p}"] = zoo[f"layers.{i}.{name}.{p}"]
    out.update({key: zoo[key] for key in CLASSIFIER})
    return config, out


def _square(cfg: HFConfig, key: str) -> int:
    """An image or patch size: an int, or a ``[h, w]`` pair with ``h == w``."""
    value = cfg[key]
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise cfg.unsupported(key, "non-square images or patches", "square sizes")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"vit config field {key} must be a positive integer or a square [h, w], got {value!r}")
    return value


def _drop_batch_axis(table: Tensor) -> Tensor:
    """``(1, 1 + N, D)`` -> ``(1 + N, D)``; any other shape is left for the shape check to report."""
    return table[0] if table.dim() == 3 and table.shape[0] == 1 else table


def _on_disk_name(key: str) -> str:
    """The on-disk name of a key that ``transformers`` 5 spells differently in memory."""
    match = _IN_MEMORY_LAYER.fullmatch(key)
    if match is None:
        return key
    prefix, index, rest = match.groups()
    for new, old in _IN_MEMORY_NAMES.items():
        if rest.startswith(new + "."):
            rest = old + rest[len(new):]
            break
    return f"{prefix}encoder.layer.{index}.{rest}"


# The published size (the tiny test size is VisionTransformer's own "tiny" preset).
VisionTransformer.register_preset("vit-base-patch16-224", dict(
    image_size=224, patch_size=16, num_channels=3, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
    num_labels=1000, dropout=0.0, attention_dropout=0.0, ffn="gelu", norm_eps=1e-12,
))
