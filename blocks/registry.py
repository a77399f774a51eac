"""One small generic registry of components, one namespace per component kind.

Components register themselves with a decorator next to their definition::

    @register("ffn", "relu")
    class ReluFFN(nn.Module): ...

and are looked up by ``(kind, name)``: ``get`` returns the object, ``build`` constructs it with a
checked set of keyword arguments, ``names`` and ``kinds`` list what exists.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, Any]] = {}


def register(kind: str, name: str) -> Callable[[T], T]:
    """Decorator registering a class or function under ``(kind, name)``.

    Raises:
        ValueError: if ``name`` is already registered for ``kind``.
    """

    def decorator(obj: T) -> T:
        entries = _REGISTRY.setdefault(kind, {})
        if name in entries:
            raise ValueError(
                f"{kind} {name!r} is already registered (by {entries[name]!r}); "
                "register a variant under a new name"
            )
        entries[name] = obj
        return obj

    return decorator


def kinds() -> list[str]:
    """All component kinds that have at least one registered entry, sorted."""
    return sorted(_REGISTRY)


def names(kind: str) -> list[str]:
    """The registered names of one kind, sorted.

    Raises:
        ValueError: if ``kind`` is not a known component kind.
    """
    return sorted(_entries(kind))


def get(kind: str, name: str) -> Any:
    """Return the registered class or function ``name`` of ``kind``.

    Raises:
        ValueError: if the kind or the name is unknown; the message lists the valid ones.
    """
    entries = _entries(kind)
    if name not in entries:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(entries)}")
    return entries[name]


def build(kind: str, name: str, **cfg: Any) -> Any:
    """Construct the registered component ``name`` of ``kind`` with keyword arguments ``cfg``.

    Unknown keys are rejected (never silently dropped), and so are missing required keys.

    Raises:
        ValueError: unknown kind or name, unknown or missing configuration keys.
    """
    obj = get(kind, name)
    check_kwargs(obj, cfg, what=f"{kind} {name!r}")
    return obj(**cfg)


def check_kwargs(
    obj: Callable[..., Any], cfg: Mapping[str, Any], *, what: str, supplied: Iterable[str] = ()
) -> None:
    """Raise ``ValueError`` if ``cfg`` has keys ``obj`` does not accept or lacks required ones.

    ``supplied`` names keys the caller passes itself (a block's shape, given by the model): ``cfg`` may not
    set them, and they do not count as missing. This is how block options in a model config are checked.
    """
    supplied = set(supplied)
    params = inspect.signature(obj).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [
        n for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    taken = sorted(set(cfg) & supplied)
    if taken:
        raise ValueError(f"config key(s) {taken} of {what} are set by the model itself, not by options")
    options = [n for n in accepted if n not in supplied]
    unknown = sorted(set(cfg) - set(accepted))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} for {what}; accepted keys are {options}")
    missing = [
        n for n in accepted
        if params[n].default is inspect.Parameter.empty and n not in cfg and n not in supplied
    ]
    if missing:
        raise ValueError(f"missing required config key(s) {missing} for {what}")


def _entries(kind: str) -> dict[str, Any]:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown component kind {kind!r}; expected one of {kinds()}")
    return _REGISTRY[kind]
