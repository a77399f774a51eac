"""One small generic registry of components, one namespace per component kind.

Components register themselves with a decorator next to their definition::

    @register("ffn", "relu")
    class ReluFFN(nn.Module): ...

and are looked up by ``(kind, name)``: ``get`` returns the object, ``build`` constructs it with a
checked set of keyword arguments, ``names`` and ``kinds`` list what exists.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, Any]] = {}


def register(kind: str, name: str) -> Callable[[T], T]:
    """Decorator registering a class or function under ``(kind, name)``.

    Args:
        kind: the component kind (``"attention"``, ``"ffn"`` ...); a new kind is created on first use.
        name: the component's short name (``"swiglu"``).

    Returns:
        The decorator; it returns the object unchanged.

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
    """All component kinds that have at least one registered entry, sorted.

    Returns:
        The kinds.
    """
    return sorted(_REGISTRY)


def names(kind: str) -> list[str]:
    """The registered names of one kind, sorted.

    Args:
        kind: a component kind.

    Returns:
        The names.

    Raises:
        ValueError: if ``kind`` is not a known component kind.
    """
    return sorted(_entries(kind))


def get(kind: str, name: str) -> Any:
    """Return the registered class or function ``name`` of ``kind``.

    Args:
        kind: a component kind.
        name: a registered name of that kind.

    Returns:
        The class or function.

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

    Args:
        kind: a component kind.
        name: a registered name of that kind.
        **cfg: the component's keyword arguments.

    Returns:
        The component (what the class or function returns).

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

    Args:
        obj: the class or function.
        cfg: the keyword arguments to check.
        what: names the component in messages.
        supplied: keys the caller passes itself.

    Raises:
        ValueError: unknown keys, keys in ``supplied``, or missing required keys (each named).
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


#: what a value of each plain annotation must be, and how the error message says so.
_SCALARS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite float"),
    "str": (lambda v: isinstance(v, str), "a str"),
    "Mapping": (lambda v: isinstance(v, Mapping), "a mapping"),
}


def expected_type(annotation: Any, value: Any) -> str | None:
    """What ``value`` should have been for ``annotation`` (e.g. ``"int | None"``), or None when it fits.

    Plain annotations are checked strictly: a bool is not an int, a string is not a bool, a float must be finite
    (an int is a float). ``Mapping[...]``/``dict[...]`` need a mapping. An annotation with any other part
    (``Tensor``, ``Any``, a module) accepts every value.

    Args:
        annotation: a parameter's annotation (a string under ``from __future__ import annotations``).
        value: the value given.

    Returns:
        The expected type as text, or None.
    """
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [part.strip() for part in text.replace("Optional[", "None | ").rstrip("]").split("|")]
    if "None" in parts and value is None:
        return None
    heads = [part.split("[")[0].removeprefix("typing.") for part in parts if part != "None"]
    heads = ["Mapping" if head in ("dict", "Mapping", "MutableMapping") else head for head in heads]
    if not heads or any(head not in _SCALARS for head in heads):
        return None
    if any(_SCALARS[head][0](value) for head in heads):
        return None
    return " or ".join([*(_SCALARS[head][1] for head in heads), *(["None"] if "None" in parts else [])])


def check_option_types(obj: Callable[..., Any], cfg: Mapping[str, Any], *, what: str) -> None:
    """Raise ``ValueError`` unless every value of ``cfg`` fits ``obj``'s parameter of that name.

    The parameter's annotation decides (``expected_type``); without one, the type of its default (a bool, int,
    float or str). Every float anywhere in a value, nested mappings and lists included, must be finite:
    ``{"scale": inf}`` or ``{"bias": "false"}`` are refused when the config is built, not used by the model.
    Call ``check_kwargs`` first (it rejects unknown keys).

    Args:
        obj: the class or function.
        cfg: the options.
        what: names the component in messages.

    Raises:
        ValueError: naming ``what``, the option, its value and what was expected.
    """
    params = inspect.signature(obj).parameters
    for name, value in cfg.items():
        param = params.get(name)
        expected = None
        if param is not None:
            annotation = param.annotation
            if annotation is inspect.Parameter.empty and isinstance(param.default, (bool, int, float, str)):
                annotation = type(param.default).__name__
            if annotation is not inspect.Parameter.empty:
                expected = expected_type(annotation, value)
        if expected is None and not _all_finite(value):
            expected = "finite numbers (no inf or nan)"
        if expected is not None:
            raise ValueError(f"option {name!r} of {what} must be {expected}, got {value!r}")


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    return True


def _entries(kind: str) -> dict[str, Any]:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown component kind {kind!r}; expected one of {kinds()}")
    return _REGISTRY[kind]
