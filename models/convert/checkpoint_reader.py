"""Reading the state dict of a ``transformers`` checkpoint for a converter: tensors handed out by name, and every
tensor left unused reported, so a converter never silently drops part of a model.

``models.convert.hf_checkpoint`` re-exports ``CheckpointReader`` beside ``HFConfig`` (the config side).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping

from torch import Tensor


class CheckpointReader:
    """Hands out a checkpoint's tensors by their ``transformers`` names and reports any left unused.

    Args:
        model_type: the family (for messages).
        state_dict: the checkpoint.
        prefix: the task model's prefix of the base model (``"transformer."``, ``"bert."``, ``"model."``),
            stripped where present so that base-model checkpoints read the same way.
        ignore: regular expressions of keys that carry nothing the model needs (stale buffers).

    Raises:
        ValueError: a non-string key, a non-tensor value, or a name held both with and without ``prefix``.

    Shapes: the tensors are handed out as stored.
    """

    def __init__(
        self,
        model_type: str,
        state_dict: Mapping[str, Tensor],
        prefix: str = "",
        ignore: Iterable[str] = (),
    ) -> None:
        self.model_type = model_type
        self.tensors: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if not isinstance(key, str) or not isinstance(value, Tensor):
                raise ValueError(
                    f"a state dict maps str keys to tensors; got {type(key).__name__} -> {type(value).__name__} "
                    f"for key {key!r}"
                )
            name = key[len(prefix):] if prefix and key.startswith(prefix) else key
            if name in self.tensors:
                raise ValueError(f"{model_type} checkpoint holds {name!r} both with and without the {prefix!r} prefix")
            self.tensors[name] = value
        patterns = [re.compile(p) for p in ignore]
        self.unused = {k for k in self.tensors if not any(p.fullmatch(k) for p in patterns)}

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds ``key``.

        Args:
            key: the tensor's name (without the prefix).

        Returns:
            True when it is there (used or not).
        """
        return key in self.tensors

    def has_prefix(self, prefix: str) -> bool:
        """Whether some tensor's name starts with ``prefix``.

        Args:
            prefix: the start of a name (``"pooler."``).

        Returns:
            True when one does.
        """
        return any(k.startswith(prefix) for k in self.tensors)

    def take(self, key: str) -> Tensor:
        """The tensor stored under ``key``, marked as used.

        Args:
            key: the tensor's ``transformers`` name (without the prefix).

        Returns:
            The tensor.

        Raises:
            ValueError: the checkpoint lacks it.

        Shapes: as stored.
        """
        if key not in self.tensors:
            raise ValueError(f"{self.model_type} checkpoint lacks the tensor {key!r}")
        self.unused.discard(key)
        return self.tensors[key]

    def take_first(self, *keys: str) -> Tensor:
        """The first of several names one tensor may be stored under (tied weights); all count as used.

        Args:
            *keys: the names, in order of preference.

        Returns:
            The tensor under the first name present.

        Raises:
            ValueError: the checkpoint holds none of them.

        Shapes: as stored.
        """
        found = [k for k in keys if k in self.tensors]
        if not found:
            raise ValueError(f"{self.model_type} checkpoint lacks the tensor {keys[0]!r} (also looked for {keys[1:]})")
        self.unused.difference_update(keys)
        return self.tensors[found[0]]

    def skip(self, *keys: str) -> None:
        """Mark names as used without reading them (aliases of a tied weight the model reads elsewhere).

        Args:
            *keys: the names.
        """
        self.unused.difference_update(keys)

    def drop(self, pattern: str, what: str) -> None:
        """Leave out every key matching ``pattern`` (a head the zoo model does not have), with a warning.

        Args:
            pattern: a regular expression matched against the whole key.
            what: the part left out (for the warning).
        """
        regex = re.compile(pattern)
        dropped = sorted(k for k in self.unused if regex.fullmatch(k))
        if dropped:
            self.unused.difference_update(dropped)
            warnings.warn(
                f"{self.model_type} checkpoint: leaving out {what} ({len(dropped)} tensors, e.g. {dropped[0]!r}); "
                "the zoo model has no such part",
                stacklevel=4,
            )

    def finish(self) -> None:
        """Raise ``ValueError`` if any tensor was not used: the checkpoint holds parts the zoo cannot place.

        Raises:
            ValueError: naming the unused keys (the first eight).
        """
        if self.unused:
            left = sorted(self.unused)
            shown = ", ".join(repr(k) for k in left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            raise ValueError(
                f"{self.model_type} checkpoint holds tensors the zoo model has no place for: {shown} "
                "(a task head or an architecture variant the zoo does not represent)"
            )
