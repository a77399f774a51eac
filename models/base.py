"""What every zoo model shares: presets, backend switching, input checks, positions from masks."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks
import blocks.layers
from blocks.kv_cache import LayerCache
from blocks.positional import PositionalEncoding

from .adapters import AdapterMixin
from .config import ConfigBase


class ZooModel(AdapterMixin, nn.Module):
    """Base class of the zoo's models.

    Subclasses set ``config_class`` and ``presets`` (name -> config overrides) and build themselves
    from ``config`` alone.
    """

    config_class: ClassVar[type[ConfigBase]] = ConfigBase
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, config: ConfigBase) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ZooModel:
        """Build a model from a named preset, with any config field overridden.

        Raises:
            ValueError: unknown preset (the valid names are listed) or unknown/invalid overrides.
        """
        return cls(cls.preset_config(name, **overrides))

    @classmethod
    def preset_config(cls, name: str, **overrides: Any) -> ConfigBase:
        """The config of a preset, with overrides applied."""
        if name not in cls.presets:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; expected one of {sorted(cls.presets)}")
        return cls.config_class.from_dict({**cls.presets[name], **overrides})

    @classmethod
    def register_preset(cls, name: str, config: dict[str, Any]) -> None:
        """Add a named preset (a family's ``tiny`` test size or a published model's size); the config is validated.

        Raises:
            ValueError: the name is taken, or the config is invalid.
        """
        if name in cls.presets:
            raise ValueError(f"{cls.__name__} preset {name!r} already exists")
        cls.config_class.from_dict(config)
        cls.presets[name] = dict(config)

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention module to the registered backend ``name`` (a runtime choice)."""
        blocks.get("attention_backend", name)  # validates the name before anything changes
        for module in self.modules():
            if isinstance(module, blocks.MultiHeadAttention):
                module.set_backend(name)
        self.config = self.config.replace(attention_backend=name)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ input checks
    def check_ids(self, ids: Tensor, name: str) -> None:
        """Raise ``ValueError`` unless ``ids`` is a ``(B, L)`` integer tensor of ids in ``[0, vocab_size)``."""
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be a (B, L) tensor of token ids, got {shape}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        # Value checks read tensor data; under torch.compile they would break the graph, so they are skipped.
        if ids.numel() and not torch.compiler.is_compiling():
            vocab = self.config.vocab_size
            outside = (ids < 0) | (ids >= vocab)
            if bool(outside.any()):  # one host sync per call; the offending id is looked up only on error
                bad = int(ids[outside][0])
                raise ValueError(f"{name} contains id {bad}, outside the vocabulary [0, vocab_size={vocab})")

    @staticmethod
    def check_mask(mask: Tensor | None, shape: tuple[int, ...], name: str) -> Tensor | None:
        """Validate a ``(B, L)`` padding mask (True/1 = real token) and return it as bool."""
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{name} must have shape {tuple(shape)} (B, L) matching the ids, got {got}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_floating_point or (
                not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all())
            ):
                raise ValueError(f"{name} must be bool or 0/1 integers (1 = real token), got dtype {mask.dtype}")
            mask = mask.bool()
        return mask


def layer_kwargs(config: Any) -> dict[str, Any]:
    """The keyword arguments of the registered ``encoder``/``decoder`` layer builders, taken from a config."""
    c = config
    return dict(
        d_model=c.d_model, n_heads=c.n_heads, d_ff=c.d_ff, n_kv_heads=c.n_kv_heads, d_head=c.d_head,
        d_value=c.d_value, dropout=c.dropout, attention_dropout=c.attention_dropout, ffn=c.ffn, norm=c.norm,
        norm_eps=c.norm_eps, sublayer=c.sublayer, attention=c.attention, attention_backend=c.attention_backend,
        bias=c.bias,
    )


def build_norm(config: Any) -> nn.Module:
    """A norm of the config's kind, width ``d_model``, with the config's norm options."""
    options = config.block_options("norm") if hasattr(config, "block_options") else {}
    return blocks.build("norm", config.norm, d_model=config.d_model, eps=config.norm_eps, **options)


def final_norm(config: Any) -> nn.Module:
    """A norm after the last layer for pre-norm stacks (they leave the residual stream unnormalised),
    the identity for post-norm ones."""
    if config.sublayer in ("pre_norm", "sandwich_norm"):
        return build_norm(config)
    return nn.Identity()


def build_layers(config: Any, builder: str, indices: range, **extra: Any) -> nn.ModuleList:
    """The layers ``indices`` of a stack, each built by the registered ``layer`` builder with its block options
    (``config.options`` with ``config.layer_options[i]`` merged over them)."""
    layers = []
    for i in indices:
        options = {kind: config.block_options(kind, i) for kind in blocks.layers.LAYER_OPTION_KINDS}
        layers.append(blocks.build(
            "layer", builder, **layer_kwargs(config), options={k: v for k, v in options.items() if v},
            **config.block_options("layer", i), **extra,
        ))
    return nn.ModuleList(layers)


def build_positional(config: Any, causal: bool, layer: int | None = None) -> PositionalEncoding:
    """The config's positional encoding for a causal or bidirectional stack, with its options (of ``layer``)."""
    return blocks.build(
        "positional", config.positional, d_model=config.d_model, n_heads=config.n_heads, d_head=config.d_head,
        max_len=config.max_len, causal=causal, **config.block_options("positional", layer),
    )


def layer_positionals(config: Any, indices: range, causal: bool) -> nn.ModuleDict:
    """Positional encodings of the layers whose ``layer_options`` change the positional options (e.g. ModernBERT's
    local layers rotate with another base), keyed by the layer's index in its stack. They act inside attention
    only (``rotate``, ``attention_bias``); what the stack's encoding adds to the embeddings is not repeated."""
    out = {}
    for j, i in enumerate(indices):
        if config.layer_options and config.layer_options[i].get("positional"):
            out[str(j)] = build_positional(config, causal, i)
    return nn.ModuleDict(out)


def positional_per_layer(
    stack: PositionalEncoding, overrides: nn.ModuleDict, n_layers: int, positions: Tensor, key_positions: Tensor
) -> list[tuple[PositionalEncoding | None, Tensor | None]]:
    """``(rotary, attention bias)`` for each layer of a stack; each distinct encoding's bias is computed once."""
    computed: dict[int, tuple[PositionalEncoding | None, Tensor | None]] = {}
    out = []
    for i in range(n_layers):
        pos = overrides[str(i)] if str(i) in overrides else stack
        if id(pos) not in computed:
            computed[id(pos)] = (pos if pos.rotates else None, pos.attention_bias(positions, key_positions))
        out.append(computed[id(pos)])
    return out


def embedding_scale(config: Any) -> float:
    """``sqrt(d_model)`` with ``scale_embeddings`` (§3.4, Gemma), else 1."""
    return math.sqrt(config.d_model) if config.scale_embeddings else 1.0


def head_logits(config: Any, head: nn.Module, x: Tensor) -> Tensor:
    """Vocabulary logits from the final hidden states: ``output_scale`` before the head (T5's tied head),
    ``logit_softcap`` after it (Gemma 2: ``cap · tanh(logits / cap)``)."""
    if config.output_scale != 1.0:
        x = x * config.output_scale
    logits = head(x)
    if config.logit_softcap is not None:
        logits = torch.tanh(logits / config.logit_softcap) * config.logit_softcap
    return logits


def positions_from_mask(mask: Tensor | None, past: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Positions of the new queries and of all keys.

    With a padding mask ``(B, past + length)`` positions count real tokens only, so a left- or
    right-padded row gets the same positions as the sequence alone; without one, they are
    ``past .. past + length - 1``.

    Returns:
        ``(query_positions (B|1, length), key_positions (B|1, past + length))``, long.
    """
    if mask is None:
        keys = torch.arange(past + length, device=device)[None]
    else:
        keys = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return keys[:, past:], keys


def new_caches(n_layers: int, max_len: int, cross: bool = False) -> list[LayerCache]:
    """One empty ``LayerCache`` per decoder layer, preallocating ``max_len`` positions."""
    return [LayerCache(max_len, cross=cross) for _ in range(n_layers)]


def cached_length(cache: list[LayerCache] | None) -> int:
    """Number of positions already in a decoder cache (0 without one)."""
    return 0 if not cache else cache[0].self_attn.length


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over positions whose label is not -100.

    With every label ignored (an empty micro-batch) the loss is 0 with zero gradient, not NaN, so one such batch
    cannot poison a run.

    Raises:
        ValueError: labels that are not integers, or ids outside ``[0, vocab_size)`` other than -100 (named).
    """
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must hold integer token ids (or -100), got dtype {labels.dtype}")
    vocab = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab).float(), labels.reshape(-1)
    kept = flat_labels != -100
    if not torch.compiler.is_compiling():  # (reads tensor data: one host sync, skipped inside a compiled graph)
        outside = kept & ((flat_labels < 0) | (flat_labels >= vocab))
        if bool(outside.any()):
            bad = int(flat_labels[outside][0])
            raise ValueError(f"labels contain {bad}, outside the vocabulary [0, vocab_size={vocab}) and not -100")
    total = nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    return total / kept.sum().clamp(min=1)
