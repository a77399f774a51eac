"""Synthetic sequence-to-sequence tasks, generated on the fly with a deterministic answer.

- ``copy``: the target is the source (the annotated transformer's first test).
- ``reverse``: the target is the source backwards.
- ``add``: the source is two decimal numbers ``a + b`` (digits, most significant first), the target their
  sum — harder, because every output digit depends on a carry chain through the source.

Ids 0-4 are the special tokens of every zoo tokenizer (``[PAD] [UNK] [BOS] [EOS] [MASK]``); symbols
follow from id 5. Sources and targets end with ``[EOS]``, as the seq2seq template makes them, so the
examples go straight into ``Seq2SeqCollator``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import overload

PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3, 4
FIRST_SYMBOL = 5
TASKS = ("copy", "reverse", "add")
_ADD_SYMBOLS = "0123456789+"

Example = tuple[list[int], list[int]]


class SyntheticTask(Sequence[Example]):
    """``size`` examples of a task; example ``i`` depends only on ``(task, seed, i)``.

    Args:
        task: "copy", "reverse" or "add".
        size: number of examples.
        n_symbols: alphabet size of copy/reverse (``add`` always uses the 10 digits and "+").
        min_len: shortest sequence of copy/reverse, or fewest digits of each number for add.
        max_len: longest sequence of copy/reverse, or most digits of each number for add.
        seed: selects the examples.

    Raises:
        ValueError: an unknown task or bad sizes.
    """

    def __init__(self, task: str, size: int, *, n_symbols: int = 10, min_len: int = 1, max_len: int = 10,
                 seed: int = 0) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")
        for name, value in (("size", size), ("n_symbols", n_symbols), ("min_len", min_len), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if min_len > max_len:
            raise ValueError(f"min_len={min_len} must be <= max_len={max_len}")
        self.task, self.size, self.seed = task, size, seed
        self.n_symbols = len(_ADD_SYMBOLS) if task == "add" else n_symbols
        self.min_len, self.max_len = min_len, max_len

    @property
    def vocab_size(self) -> int:
        """Ids needed: the 5 special tokens plus the symbols."""
        return FIRST_SYMBOL + self.n_symbols

    @property
    def max_source_length(self) -> int:
        return (2 * self.max_len + 1 if self.task == "add" else self.max_len) + 1

    @property
    def max_target_length(self) -> int:
        return (self.max_len + 1 if self.task == "add" else self.max_len) + 1

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> Example: ...

    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...

    def __getitem__(self, index: int | slice) -> Example | list[Example]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} examples")
        rng = random.Random(f"{self.task}:{self.seed}:{index % self.size}")
        if self.task == "add":
            a, b = (self._number(rng) for _ in range(2))
            source = self.encode(f"{a}+{b}")
            target = self.encode(str(a + b))
        else:
            length = rng.randint(self.min_len, self.max_len)
            source = [FIRST_SYMBOL + rng.randrange(self.n_symbols) for _ in range(length)]
            target = source if self.task == "copy" else source[::-1]
        return source + [EOS_ID], list(target) + [EOS_ID]

    def _number(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_len, self.max_len)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def answer(self, source: Sequence[int]) -> list[int]:
        """The correct target of a source (``[EOS]`` included), computed from the source alone.

        Args:
            source: the source ids (``[EOS]`` optional).

        Returns:
            The target ids, ending with ``[EOS]``.
        """
        body = [t for t in source if t != EOS_ID]
        if self.task == "copy":
            target = body
        elif self.task == "reverse":
            target = body[::-1]
        else:
            a, b = self.decode(body).split("+")
            target = self.encode(str(int(a) + int(b)))
        return list(target) + [EOS_ID]

    def encode(self, text: str) -> list[int]:
        """Ids of a string of symbols (``a``, ``b``, ... for copy/reverse; digits and "+" for add).

        Args:
            text: the symbols.

        Returns:
            Their ids.

        Raises:
            ValueError: a character that is not a symbol of the task, naming it.
        """
        alphabet = self._alphabet()
        bad = [c for c in text if c not in alphabet]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a symbol of the {self.task} task; symbols are {alphabet!r}")
        return [FIRST_SYMBOL + alphabet.index(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The symbols of ``ids`` as a string; special tokens are dropped.

        Args:
            ids: token ids.

        Returns:
            The string of symbols.
        """
        alphabet = self._alphabet()
        return "".join(alphabet[i - FIRST_SYMBOL] for i in ids if FIRST_SYMBOL <= i < self.vocab_size)

    def _alphabet(self) -> str:
        if self.task == "add":
            return _ADD_SYMBOLS
        return "".join(chr(ord("a") + k) if k < 26 else chr(0x100 + k) for k in range(self.n_symbols))


def held_out(train: SyntheticTask, size: int, seed: int) -> list[Example]:
    """``size`` examples of ``train``'s task whose sources do not occur in ``train`` (a real test set).

    Args:
        train: the training set.
        size: examples to return.
        seed: the seed of the held-out draw (must differ from ``train``'s).

    Returns:
        ``(source, target)`` pairs.

    Raises:
        ValueError: ``seed`` equals the training seed, or the task space is too small to find enough
            unseen sources.
    """
    if seed == train.seed:
        raise ValueError(f"the held-out seed must differ from the training seed {train.seed}")
    seen = {tuple(src) for src, _ in train}
    fresh = SyntheticTask(train.task, 50 * size, n_symbols=train.n_symbols if train.task != "add" else 10,
                          min_len=train.min_len, max_len=train.max_len, seed=seed)
    out: list[Example] = []
    for example in fresh:
        if tuple(example[0]) not in seen:
            seen.add(tuple(example[0]))  # and no duplicates within the test set
            out.append(example)
            if len(out) == size:
                return out
    raise ValueError(f"found only {len(out)} of {size} unseen {train.task} sources; use longer sequences")
