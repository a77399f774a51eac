"""Model configurations: frozen dataclasses naming their blocks by registry name, so a config is plain JSON."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import blocks
from blocks.layers import SUPPLIED as LAYER_SUPPLIED
from blocks.registry import check_option_types, expected_type

C = TypeVar("C", bound="ConfigBase")

#: The longest context (``max_len``) a config may claim: 2**24 tokens (the longest published context is ~10M); a
#: larger claim is refused before anything is sized from it (rotary tables, default caches).
MAX_POSITIONS = 1 << 24


@dataclasses.dataclass(frozen=True)
class ConfigBase:
    """A frozen dataclass config that round-trips through a plain JSON dict."""

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict of every field.

        Returns:
            Field name -> value (what ``config.json`` holds).
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Inverse of ``to_dict``; rejects keys that are not fields of this config.

        Args:
            data: field name -> value.

        Returns:
            The validated config.

        Raises:
            ValueError: unknown keys (named), or invalid values.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**data)

    #: fields whose default is derived from other fields (name -> function of the config giving the default).
    derived: ClassVar[dict[str, Any]] = {}

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied (validated; unknown keys rejected).

        A derived field (e.g. ``n_kv_heads``, ``d_head``) that holds its default is derived again from the new
        values unless ``changes`` sets it: ``replace(n_heads=8)`` of a 4-head config gives 8 key/value heads,
        not a silent GQA model.

        Args:
            **changes: field name -> new value.

        Returns:
            The new config.
        """
        data = self.to_dict()
        for name, default in (type(self).derived or {}).items():
            if name not in changes and data.get(name) == default(self):
                data[name] = None
        return self.from_dict({**data, **changes})


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ConfigBase):
    """Fields shared by every model family; validated in ``__post_init__``.

    ``n_kv_heads`` defaults to ``n_heads``, ``d_head`` to ``d_model // n_heads`` and ``d_value`` to
    ``d_head``; the defaults are filled in at construction so ``to_dict`` shows the effective values.

    Attributes:
        vocab_size: number of token ids.
        d_model: the model's width.
        n_heads: attention (query) heads.
        n_kv_heads: key/value heads (fewer than ``n_heads``: GQA; 1: MQA).
        d_head: query/key width per head.
        d_value: value width per head.
        d_ff: the feed-forward block's inner width.
        dropout: dropout on sublayer outputs and embeddings.
        attention_dropout: dropout on the attention weights.
        max_len: the longest sequence (learned positions have this many rows).
        positional: registered ``positional`` block.
        ffn: registered ``ffn`` block.
        norm: registered ``norm`` block.
        norm_eps: the norms' epsilon.
        sublayer: registered ``sublayer`` (residual connection) block.
        attention: registered ``attention`` block.
        attention_backend: registered ``attention_backend`` (a runtime choice; see ``set_attention_backend``).
        bias: biases in the linear layers.
        tie_embeddings: the output head shares the token embedding.
        pad_token_id: the padding id (None: none).
        bos_token_id: the begin-of-sequence id.
        eos_token_id: the end-of-sequence id.
        scale_embeddings: multiply embeddings by ``sqrt(d_model)``.
        logit_softcap: Gemma 2's final soft-capping of the logits, or None.
        output_scale: T5's rescaling of the hidden states before a tied head.
        options: block key -> keyword options of that block (see the models guide).
        layer_options: none, or one such dict per layer, merged over ``options``.

    Raises:
        ValueError: a field of the wrong type, out of range or naming no registered block (named with its value).
    """

    vocab_size: int = 1000
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_value: int | None = None
    d_ff: int = 256
    dropout: float = 0.1
    attention_dropout: float = 0.0
    max_len: int = 512
    positional: str = "sinusoidal"
    ffn: str = "relu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    sublayer: str = "post_norm"
    attention: str = "mha"
    attention_backend: str = "sdpa"
    bias: bool = True
    tie_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 3
    scale_embeddings: bool = False
    logit_softcap: float | None = None
    output_scale: float = 1.0
    options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    layer_options: tuple[dict[str, dict[str, Any]], ...] = ()

    derived: ClassVar[dict[str, Any]] = {
        "n_kv_heads": lambda c: c.n_heads,
        "d_head": lambda c: c.d_model // c.n_heads,
        "d_value": lambda c: c.d_head,
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            check_positive_int(self, name)
        if self.max_len > MAX_POSITIONS:
            raise ValueError(f"max_len={self.max_len} exceeds MAX_POSITIONS={MAX_POSITIONS} (2**24 positions)")
        check_attention_shape(self)
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be None or a finite number > 0, got {self.logit_softcap!r}")
        if not self.output_scale > 0:
            raise ValueError(f"output_scale must be a finite number > 0, got {self.output_scale!r}")
        for field, kind in (
            ("positional", "positional"),
            ("ffn", "ffn"),
            ("norm", "norm"),
            ("sublayer", "sublayer"),
            ("attention", "attention"),
            ("attention_backend", "attention_backend"),
        ):
            value = getattr(self, field)
            if value not in blocks.names(kind):
                raise ValueError(f"{field}={value!r} is not a registered {kind}; expected one of {blocks.names(kind)}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value!r} must be None or an id in [0, vocab_size={self.vocab_size})")
        object.__setattr__(self, "options", check_options(self, self.options, "options"))
        length = self.options.get("head", {}).get("max_seq_length")
        if isinstance(length, int) and length > self.max_len:
            raise ValueError(f"options['head'].max_seq_length={length} exceeds the model's positions "
                             f"(max_len={self.max_len})")
        if isinstance(self.layer_options, (list, tuple)):
            object.__setattr__(self, "layer_options", tuple(
                check_options(self, entry, f"layer_options[{i}]") for i, entry in enumerate(self.layer_options)
            ))
        else:
            raise ValueError(f"layer_options must be a list of per-layer option dicts, got {self.layer_options!r}")

    #: the block each option key configures: key -> (config field naming the block, registry kind).
    option_blocks: ClassVar[dict[str, tuple[str, str]]] = {
        "positional": ("positional", "positional"),
        "attention": ("attention", "attention"),
        "ffn": ("ffn", "ffn"),
        "norm": ("norm", "norm"),
        "sublayer": ("sublayer", "sublayer"),
    }

    def layer_builders(self) -> list[str]:
        """The registered ``layer`` builders this model uses (``layer`` options are checked against them).

        Returns:
            Their registry names.
        """
        return ["encoder", "decoder"]

    def check_layer_options_length(self, n_layers: int) -> None:
        """Check that ``layer_options`` is empty or has one entry per layer.

        Args:
            n_layers: the number of layers.

        Raises:
            ValueError: another number of entries.
        """
        if self.layer_options and len(self.layer_options) != n_layers:
            raise ValueError(
                f"layer_options has {len(self.layer_options)} entries; expected none or one per layer ({n_layers})"
            )

    def block_options(self, key: str, layer: int | None = None) -> dict[str, Any]:
        """The options of one block (``key`` as in ``options``), with ``layer_options[layer]`` merged over them.

        Args:
            key: the block's key in ``options`` (``attention``, ``ffn``, ``positional`` ...).
            layer: the layer's index, or None for the model-wide options.

        Returns:
            A fresh copy of the options.
        """
        merged = dict(self.options.get(key, {}))
        if layer is not None and self.layer_options:
            merged.update(self.layer_options[layer].get(key, {}))
        return copy.deepcopy(merged)


#: keys of a positional encoding set by the model (its shape), never by options.
POSITIONAL_SUPPLIED = ("d_model", "n_heads", "d_head", "max_len", "causal")
#: keys of a layer builder set by the model.
LAYER_BUILDER_SUPPLIED = (
    "d_model", "n_heads", "d_ff", "n_kv_heads", "d_head", "d_value", "dropout", "attention_dropout", "ffn", "norm",
    "norm_eps", "sublayer", "attention", "attention_backend", "bias", "cross_attention", "options",
)


def check_options(config: Any, options: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate block options against the signatures of the blocks the config names; return a plain copy.

    ``options`` maps a key of ``config.option_blocks`` (or ``"layer"``) to keyword options of that block. Keys the
    model sets itself (the block's shape) are refused, and so are keys the block does not take. Values are typed
    like config fields (``blocks.registry.check_option_types``): checked against the block's annotation (or its
    default's type), a bool is not an int, a string is not a bool, floats are finite.

    Args:
        config: the config being validated.
        options: the options to check.
        where: what they are, for messages (``options``, ``layer_options[3]``).

    Returns:
        A plain copy of the options.

    Raises:
        ValueError: not a dict of dicts, an unknown block key, an option the block does not accept, or a value of
            the wrong type or not finite (block, option and value named).
    """
    if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
        raise ValueError(f"{where} must map block names to dicts of options, got {options!r}")
    known = [*config.option_blocks, "layer"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{where} names unknown block(s) {unknown}; expected some of {known}")
    for key, values in options.items():
        if any(not isinstance(name, str) for name in values):
            raise ValueError(f"{where}[{key!r}] must have string keys, got {sorted(map(repr, values))}")
        if key == "layer":
            for builder in config.layer_builders():
                what = f"{where}['layer'] (layer {builder!r})"
                blocks.check_kwargs(blocks.get("layer", builder), values, what=what, supplied=LAYER_BUILDER_SUPPLIED)
                check_option_types(blocks.get("layer", builder), values, what=what)
            continue
        field, kind = config.option_blocks[key]
        name = getattr(config, field)
        supplied = POSITIONAL_SUPPLIED if kind == "positional" else LAYER_SUPPLIED[kind]
        what = f"{where}[{key!r}] ({kind} {name!r})"
        blocks.check_kwargs(blocks.get(kind, name), values, what=what, supplied=supplied)
        check_option_types(blocks.get(kind, name), values, what=what)
    return copy.deepcopy({key: dict(values) for key, values in options.items()})


def check_attention_shape(config: Any) -> None:
    """Validate and fill the attention fields every config shares.

    ``n_kv_heads``, ``d_head`` and ``d_value`` default to ``n_heads``, ``d_model // n_heads`` and ``d_head``
    (filled in on the frozen instance); dropouts must lie in [0, 1) and ``norm_eps`` be positive.

    Args:
        config: the config being validated (changed in place).

    Raises:
        ValueError: naming the bad value.
    """
    check_field_types(config)
    for name in ("n_kv_heads", "d_head", "d_value"):
        if getattr(config, name) is not None:
            check_positive_int(config, name)
    if config.n_kv_heads is None:
        object.__setattr__(config, "n_kv_heads", config.n_heads)
    if config.n_heads % config.n_kv_heads:
        raise ValueError(f"n_heads={config.n_heads} must be divisible by n_kv_heads={config.n_kv_heads}")
    if config.d_head is None:
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model={config.d_model} is not divisible by n_heads={config.n_heads}; set d_head explicitly"
            )
        object.__setattr__(config, "d_head", config.d_model // config.n_heads)
    if config.d_value is None:
        object.__setattr__(config, "d_value", config.d_head)
    for name in ("dropout", "attention_dropout"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    eps = config.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"norm_eps must be a finite number > 0, got {eps!r}")


def check_field_types(config: Any) -> None:
    """Check every ``bool``, ``int``, ``float`` and ``str`` field (optionally ``| None``) strictly.

    A bool is not an int, a string is not a bool, and a float must be finite: ``tie_embeddings="false"``,
    ``pad_token_id=True`` or ``norm_eps=nan`` are refused instead of building a different model.

    Args:
        config: the config being validated.

    Raises:
        ValueError: naming the field, the value and the expected type.
    """
    for field in dataclasses.fields(config):
        annotation = str(field.type)
        if "[" in annotation:  # containers (options, layer_options, ...) are checked by their own validators
            continue
        expected = expected_type(annotation, getattr(config, field.name))
        if expected is not None:
            raise ValueError(f"{field.name} must be {expected}, got {getattr(config, field.name)!r}")


def check_positive_int(config: Any, name: str) -> None:
    """Check that ``config.<name>`` is a positive integer.

    Args:
        config: the config being validated.
        name: the field.

    Raises:
        ValueError: anything else (a bool included), naming the field and the value.
    """
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
