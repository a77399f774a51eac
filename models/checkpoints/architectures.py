"""The architecture registry: ``config.json``'s ``"architecture"`` name -> the zoo model class that loads it.

Each model class registers itself with the ``@register_architecture`` decorator written above its definition, as
blocks register with ``@blocks.register``; ``models.auto.from_pretrained`` looks the class up here.
"""

from __future__ import annotations

from torch import nn

_ARCHITECTURES: dict[str, type[nn.Module]] = {}


def register_architecture(cls: type[nn.Module]) -> type[nn.Module]:
    """Register ``cls`` under its class name ; used as a decorator on each model class.

    Re-defining the same class (same module and qualified name, e.g. on reload) replaces the entry.

    Args:
        cls: the model class.

    Returns:
        ``cls`` unchanged.

    Raises:
        ValueError: another class already holds that name.
    """
    name = cls.__name__
    old = _ARCHITECTURES.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"architecture name {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
            f"cannot register {cls.__module__}.{cls.__qualname__} under the same name"
        )
    _ARCHITECTURES[name] = cls
    return cls


def get_architecture(name: str) -> type[nn.Module]:
    """The registered model class called ``name``.

    Args:
        name: the class's name, as ``config.json``'s ``architecture`` holds it.

    Returns:
        The class.

    Raises:
        ValueError: unknown name (the registered names are listed).
    """
    if name not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; registered architectures are {architectures()}")
    return _ARCHITECTURES[name]


def architectures() -> list[str]:
    """Sorted names of every registered architecture.

    Returns:
        The names.
    """
    return sorted(_ARCHITECTURES)
