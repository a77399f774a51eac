"""Model configurations: frozen dataclasses naming their blocks by registry name, so a config is plain JSON."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import blocks

C = TypeVar("C", bound="ConfigBase")


@dataclasses.dataclass(frozen=True)
class ConfigBase:
    """A frozen dataclass config that round-trips through a plain JSON dict."""

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Inverse of ``to_dict``; rejects keys that are not fields of this config.

        Raises:
            ValueError: unknown keys (named), or invalid values.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**data)

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied (validated; unknown keys rejected)."""
        return self.from_dict({**self.to_dict(), **changes})


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ConfigBase):
    """Fields shared by every model family; validated in ``__post_init__``.

    ``n_kv_heads`` defaults to ``n_heads``, ``d_head`` to ``d_model // n_heads`` and ``d_value`` to
    ``d_head``; the defaults are filled in at construction so ``to_dict`` shows the effective values.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            check_positive_int(self, name)
        check_attention_shape(self)
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
            if value is not None and (not isinstance(value, int) or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name}={value!r} must be None or an id in [0, vocab_size={self.vocab_size})")


def check_attention_shape(config: Any) -> None:
    """Validate and fill the attention fields every config shares.

    ``n_kv_heads``, ``d_head`` and ``d_value`` default to ``n_heads``, ``d_model // n_heads`` and ``d_head``
    (filled in on the frozen instance); dropouts must lie in [0, 1) and ``norm_eps`` be positive.

    Raises:
        ValueError: naming the bad value.
    """
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
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"norm_eps must be > 0, got {eps!r}")


def check_positive_int(config: Any, name: str) -> None:
    """Raise ``ValueError`` unless ``config.<name>`` is a positive integer."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
