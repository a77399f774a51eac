"""``PresetTable``: the named configs of a model class, found whatever the case and whether words are joined by
``-`` or ``_``.

Preset names follow one convention — lowercase, words joined by ``-`` (``gpt-oss-tiny``, ``qwen2.5-0.5b``) — and a
name is looked up in that form, so ``gpt_oss-tiny`` (a ``transformers`` model type) and ``GPT-OSS-20B`` find their
presets too. An unknown name is refused with the closest names (``difflib``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def preset_key(name: str) -> str:
    """The canonical form of a preset name: lowercase, ``_`` written as ``-``.

    Args:
        name: a preset name in any spelling.

    Returns:
        The canonical name.

    Raises:
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"a preset name must be a string, got {type(name).__name__}")
    return name.strip().lower().replace("_", "-")


class PresetTable(dict[str, dict[str, Any]]):
    """A dict of preset name -> config overrides whose keys are canonical (``preset_key``): ``table[name]``,
    ``name in table`` and ``table.get(name)`` accept any spelling of a name.

    Args:
        items: the presets to start with (name -> config overrides).
    """

    def __init__(self, items: Mapping[str, dict[str, Any]] | Iterable[tuple[str, dict[str, Any]]] = ()) -> None:
        super().__init__()
        for name, config in dict(items).items():
            self[name] = config

    def __setitem__(self, name: str, config: dict[str, Any]) -> None:
        super().__setitem__(preset_key(name), config)

    def __getitem__(self, name: str) -> dict[str, Any]:
        return super().__getitem__(preset_key(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(preset_key(name))

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """``table[name]`` in any spelling, or ``default``.

        Args:
            name: a preset name.
            default: what an unknown name gives.

        Returns:
            The config overrides, or ``default``.
        """
        return super().get(preset_key(name), default) if isinstance(name, str) else default

    def unknown(self, name: str, owner: str) -> ValueError:
        """The error for a name that is not here: the closest names, or all of them when none is close.

        Args:
            name: the name asked for.
            owner: the model class's name, for the message.

        Returns:
            The ``ValueError`` to raise.
        """
        close = difflib.get_close_matches(preset_key(name), list(self), n=3, cutoff=0.6)
        if close:
            names = [repr(c) for c in close]
            hint = "did you mean " + (", ".join(names[:-1]) + " or " if len(names) > 1 else "") + names[-1] + "?"
        else:
            hint = f"expected one of {sorted(self)}"
        return ValueError(f"unknown {owner} preset {name!r}; {hint}")
