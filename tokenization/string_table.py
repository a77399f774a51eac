"""A read-only list of strings kept as one UTF-8 buffer: what a tokenizer keeps of a vocabulary it has built from.

A Python ``list`` of ``str`` costs some 60-90 bytes per string beside its characters (the object header, the
pointer, and two bytes a character for any string with one character past Latin-1, as most byte-level BPE
tokens have); 151936 tokens and as many merges hold ~25 MiB that way. A ``StringTable`` holds the UTF-8 bytes
and one 4-byte offset per string (~4 MiB for the same lists) and decodes a string when it is asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np


class StringTable(Sequence[str]):
    """Strings stored back to back as UTF-8, with the offsets where each starts; indexing decodes one.

    Compares equal to another ``StringTable`` or a list or tuple of the same strings. ``tolist()`` gives the list.

    Args:
        strings: the strings, in order.

    Raises:
        TypeError: an item that is not a ``str``, naming its index.
    """

    __slots__ = ("_data", "_offsets")

    def __init__(self, strings: Iterable[str] = ()) -> None:
        encoded = []
        for index, string in enumerate(strings):
            if not isinstance(string, str):
                raise TypeError(f"StringTable item {index} is {type(string).__name__} {string!r}; expected a str")
            encoded.append(string.encode("utf-8", "surrogatepass"))
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        self._data, self._offsets = b"".join(encoded), _narrow(offsets)

    @classmethod
    def from_utf8(cls, data: bytes, offsets: np.ndarray, what: str = "string") -> StringTable:
        """A table over UTF-8 bytes already laid back to back, each string checked to be valid UTF-8.

        Args:
            data: the strings' bytes, back to back.
            offsets: ``len + 1`` byte offsets into ``data``, non-decreasing, from 0 to ``len(data)``.
            what: what the strings are, for messages (``"GGUF tokenizer.ggml.tokens"``).

        Returns:
            The table.

        Raises:
            ValueError: offsets that do not cut ``data`` as described, or a string that is not valid UTF-8 (the
                message gives ``what[index]``, the reason, and the string's first bytes).
        """
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if (offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(data)
                or bool(np.any(offsets[1:] < offsets[:-1]))):
            raise ValueError(f"{what}: offsets must rise from 0 to {len(data)} (the data's length), one per string + 1")
        table = cls.__new__(cls)
        table._data, table._offsets = bytes(data), _narrow(offsets)
        try:
            # Valid as a whole, and no string starting inside a character (on a continuation byte 10xxxxxx): then
            # every string is whole characters, so valid on its own.
            table._data.decode("utf-8")
            starts = offsets[:-1][offsets[:-1] < offsets[1:]]
            valid = not np.any((np.frombuffer(table._data, np.uint8)[starts] & 0xC0) == 0x80)
        except UnicodeDecodeError:
            valid = False
        if not valid:
            for index in range(len(table)):
                piece = table._bytes(index)
                try:
                    piece.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{what}[{index}] is not valid UTF-8 ({err.reason} at byte {err.start}): "
                                     f"{piece[:40]!r}") from err
        return table

    @classmethod
    def from_length_prefixed(cls, buffer: Any, offset: int, count: int, what: str = "string") -> StringTable:
        """A table of ``count`` strings stored as GGUF stores them from ``offset``: each a little-endian u64 byte
        length, then its UTF-8 bytes. The lengths must already be known to lie inside ``buffer``.

        Args:
            buffer: the bytes (``bytes``, a ``memoryview`` or a uint8 array, e.g. a memory-mapped file).
            offset: where the first length starts.
            count: how many strings.
            what: what the strings are, for messages.

        Returns:
            The table (the bytes copied out of ``buffer``).

        Raises:
            ValueError: a string that is not valid UTF-8, as ``from_utf8``.
        """
        lengths, end = np.empty(count, dtype=np.int64), offset
        for index in range(count):
            lengths[index] = length = struct.unpack_from("<Q", buffer, end)[0]
            end += 8 + length
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        keep = np.ones(end - offset, dtype=bool)  # every byte but the u64 length before each string
        keep[(offsets[:-1] + 8 * np.arange(count))[:, None] + np.arange(8)] = False
        data = np.frombuffer(buffer, dtype=np.uint8, count=end - offset, offset=offset)[keep].tobytes()
        return cls.from_utf8(data, offsets, what)

    def _bytes(self, index: int) -> bytes:
        return self._data[int(self._offsets[index]): int(self._offsets[index + 1])]

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"StringTable indices must be integers or slices, not {type(index).__name__}")
        size = len(self)
        position = int(index) + size if index < 0 else int(index)
        if not 0 <= position < size:
            raise IndexError(f"StringTable index {index} is out of range for {size} strings")
        return self._bytes(position).decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        data, bounds = memoryview(self._data), self._offsets.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            yield str(data[start:end], "utf-8", "surrogatepass")

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, StringTable):
            return self._data == other._data and bool(np.array_equal(self._offsets, other._offsets))
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringTable([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"

    @property
    def nbytes(self) -> int:
        """The bytes the table holds: its UTF-8 data and its offsets."""
        return len(self._data) + self._offsets.nbytes

    def tolist(self) -> list[str]:
        """The strings as a list.

        Returns:
            A new ``list`` of ``str``.
        """
        return list(self)


def _narrow(offsets: np.ndarray) -> np.ndarray:
    """The offsets as 4-byte integers where they fit (below 4 GiB of data): half the memory."""
    return offsets.astype(np.uint32) if offsets[-1] < 2**32 else offsets
