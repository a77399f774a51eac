"""The GGUF container (llama.cpp's file format) read with every count, length and offset checked against the file.

A GGUF file is a header, a list of tensor descriptions and a data section (``gguf/docs/gguf.md``)::

    magic "GGUF", version u32, tensor_count u64, kv_count u64
    kv_count x (key: string, value type u32, value)        string = length u64 + UTF-8 bytes
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims (fastest first), type u32, offset u64)
    padding to general.alignment (default 32), then the data section; each tensor's offset is relative to it.

Everything in the header is attacker-controlled, so nothing is trusted before it is checked against the bytes that
are really there: a count is refused when its elements cannot fit in what is left of the file (each needs at least
one byte, a string at least eight), a string when its length runs past the end, and a tensor unless its type is
known, its dims are 1 to 4 positive sizes whose row is a whole number of the type's blocks, its offset is a multiple
of ``general.alignment``, its bytes lie inside the data section and no two tensors' bytes overlap. Reading the
header therefore takes time and memory proportional to the header's size, whatever it claims; array values are
not decoded here (``GGUFArray.tolist`` and ``strings`` do that on request), and tensors are views of the
memory-mapped file.

The ``gguf`` package is used for the ggml type table and, in ``models.gguf``, its reference dequantizers; its
``GGUFReader`` is not used, since it loops over claimed counts without checking them.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenization.string_table import StringTable

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts and is long gone
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types: id -> (name, struct format, size) for the scalars; strings and arrays are handled apart.
_SCALARS = {
    0: ("uint8", "<B", 1), 1: ("int8", "<b", 1), 2: ("uint16", "<H", 2), 3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4), 5: ("int32", "<i", 4), 6: ("float32", "<f", 4), 7: ("bool", "<?", 1),
    10: ("uint64", "<Q", 8), 11: ("int64", "<q", 8), 12: ("float64", "<d", 8),
}
_STRING, _ARRAY = 8, 9
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, the type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # an empty name, n_dims, one dim, the type, the offset


def meta(metadata: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    """A metadata value.

    Args:
        metadata: the file's metadata.
        key: the metadata key.
        default: the value when the key is missing.
        required: a missing value is an error.

    Returns:
        The value (or ``default``).

    Raises:
        ValueError: a required value is missing, naming the key.
    """
    value = metadata.get(key, default)
    if required and value is None:
        raise ValueError(f"the GGUF metadata has no {key!r}, which this model needs")
    return value


def size(metadata: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer from the metadata (per-layer lists, as some architectures write, are refused).

    Args:
        metadata: the file's metadata.
        key: the metadata key.
        default: the value when the key is missing (None: required).

    Returns:
        The integer.

    Raises:
        ValueError: a missing value or anything but a positive integer, naming the key and the value.
    """
    value = meta(metadata, key, default, required=True)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a positive integer")
    return value


def number(metadata: Mapping[str, Any], key: str, default: float | None) -> float:
    """A finite positive number from the metadata (a NaN epsilon or base would give NaN logits, silently).

    Args:
        metadata: the file's metadata.
        key: the metadata key.
        default: the value when the key is missing (None: required).

    Returns:
        The number, as a float.

    Raises:
        ValueError: a missing value or anything but a finite positive number, naming the key and the value.
    """
    value = meta(metadata, key, default, required=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a finite positive number")
    return float(value)


def token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    """An optional token id from the metadata, checked to lie in the vocabulary.

    Args:
        metadata: the file's metadata.
        key: the metadata key.
        vocab_size: the vocabulary's size.

    Returns:
        The id, or None when the key is missing.

    Raises:
        ValueError: a value that is not an id below ``vocab_size``.
    """
    value = metadata.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a token id below the vocabulary size {vocab_size}")
    return value


def import_gguf() -> Any:
    """The ``gguf`` package, or an ``ImportError`` that says how to install it.

    Returns:
        The module.

    Raises:
        ImportError: the package is not installed.
    """
    try:
        import gguf
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package; install it with `pip install transformer-zoo[gguf]`"
        ) from err
    return gguf


class GGUFArray:
    """An array value of the metadata, decoded only on request.

    ``len()`` is its element count (already checked to fit in the file); ``tolist()`` decodes it.

    Args:
        key: the metadata key, for messages.
        item_type: the GGUF value type of the elements.
        count: the element count.
        buf: the file's bytes.
        offset: where the first element starts.
    """

    __slots__ = ("key", "item_type", "count", "_buf", "_offset")

    def __init__(self, key: str, item_type: int, count: int, buf: np.ndarray, offset: int) -> None:
        self.key, self.item_type, self.count, self._buf, self._offset = key, item_type, count, buf, offset

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        kind = "string" if self.item_type == _STRING else _SCALARS[self.item_type][0]
        return f"<GGUF array of {self.count} {kind}>"

    def tolist(self) -> list[Any]:
        """The decoded elements.

        Returns:
            The values (strings checked to be UTF-8, as ``strings`` does).
        """
        if self.item_type == _STRING:
            return self.strings().tolist()
        _, fmt, size = _SCALARS[self.item_type]
        return np.frombuffer(self._buf, np.dtype(fmt), self.count, self._offset).tolist()

    @property
    def holds_strings(self) -> bool:
        """Whether the elements are strings (``strings()`` reads them compactly)."""
        return self.item_type == _STRING

    def strings(self) -> StringTable:
        """An array of strings as a ``tokenization.StringTable``: its UTF-8 bytes copied out of the file, each
        string decoded only when asked for (a vocabulary's tokens take ~5x less memory than as a list of ``str``).

        Returns:
            The table.

        Raises:
            ValueError: not an array of strings, or a string that is not valid UTF-8, naming ``key[index]``.
        """
        if self.item_type != _STRING:
            raise ValueError(f"GGUF metadata {self.key} is an array of {_SCALARS[self.item_type][0]}; expected strings")
        return StringTable.from_length_prefixed(self._buf, self._offset, self.count, f"GGUF {self.key}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's description, checked: ``dims`` in ggml order (fastest first), ``start``/``nbytes`` absolute.

    Attributes:
        name: the tensor's GGUF name.
        type_name: its ggml type (``"Q8_0"`` ...).
        type_id: the type's number.
        dims: its dimensions, fastest first.
        start: the byte offset of its data in the file.
        nbytes: its size in bytes.
    """

    name: str
    type_name: str
    type_id: int
    dims: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in torch's order (slowest first)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    """A checked GGUF file: its metadata (arrays as ``GGUFArray``), tensor descriptions and the mapped bytes.

    Attributes:
        path: the file.
        metadata: key -> value.
        tensors: name -> ``TensorInfo``.
        data: the whole file, memory-mapped read-only, as uint8.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray  # the whole file, memory-mapped read-only, as uint8

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as ``gguf.quants.dequantize`` takes them.

        Args:
            tensor: one of ``tensors``.

        Returns:
            uint8 ``(*shape[:-1], row bytes)``, a view of the mapped file.
        """
        rows = tensor.shape[:-1]
        return self.data[tensor.start: tensor.start + tensor.nbytes].reshape(*rows, -1)


class _Cursor:
    """Reads the header front to back; every read is checked against the file's end."""

    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf, self.size, self.offset, self.path = buf, len(buf), 0, path

    def left(self) -> int:
        return self.size - self.offset

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            raise ValueError(
                f"GGUF file {str(self.path)!r} ends inside {what}: it needs {nbytes} bytes at offset {self.offset}, "
                f"but the file has {self.left()} left (a truncated or corrupt header)"
            )

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.offset)[0]
        self.offset += size
        return value

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 count of things that each take at least ``min_bytes``, checked to fit in the rest of the file."""
        value = self.unpack("<Q", 8, what)
        if value * min_bytes > self.left():
            raise ValueError(
                f"GGUF {what}={value} cannot be right: each needs at least {min_bytes} byte(s) and only "
                f"{self.left()} bytes are left in {str(self.path)!r}"
            )
        return value

    def string(self, what: str) -> str:
        length = self.count(f"{what} length", 1)
        data = bytes(self.buf[self.offset: self.offset + length])
        self.offset += length
        return _utf8(data, what)


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"GGUF {what} is not valid UTF-8 ({err.reason} at byte {err.start}): {data[:40]!r}") from err


def read_gguf_file(path: str | os.PathLike[str]) -> GGUFFile:
    """Read and check a GGUF file's header and tensor layout; no tensor is decoded.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The checked file.

    Raises:
        ImportError: the ``gguf`` package is not installed.
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file, an unsupported version or byte order, or any count, length, type, dimension or
            offset that the file cannot hold or that breaks the format; the message names the field.
    """
    gguf = import_gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
    if path.stat().st_size < 24:
        raise ValueError(f"{str(path)!r} is not a GGUF file: {path.stat().st_size} bytes, shorter than a GGUF header")
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as err:
        raise OSError(f"cannot map the GGUF file {str(path)!r}: {err}") from err
    cursor = _Cursor(buf, path)
    magic = bytes(buf[:4])
    if magic != MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, expected {MAGIC!r}")
    cursor.offset = 4
    version = cursor.unpack("<I", 4, "the version")
    if version not in VERSIONS:
        swapped = version & 0xFFFF == 0
        raise ValueError(
            f"GGUF version={version:#x} in {str(path)!r}" + (" (a big-endian file)" if swapped else "")
            + f" is not supported; expected a little-endian file of version {' or '.join(map(str, VERSIONS))}"
        )
    tensor_count = cursor.count("tensor_count", _MIN_TENSOR_INFO_BYTES)
    kv_count = cursor.count("kv_count", _MIN_KV_BYTES)
    if tensor_count * _MIN_TENSOR_INFO_BYTES + kv_count * _MIN_KV_BYTES > cursor.left():
        raise ValueError(f"GGUF tensor_count={tensor_count} and kv_count={kv_count} together need more than the "
                         f"{cursor.left()} bytes left in {str(path)!r}")
    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"metadata key #{index}")
        if key in metadata:
            raise ValueError(f"GGUF metadata key {key!r} appears twice; expected each key once")
        metadata[key] = _value(cursor, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"GGUF general.alignment={alignment!r}: expected a positive power of two")
    infos = [_tensor_info(cursor, index) for index in range(tensor_count)]
    data_start = -(-cursor.offset // alignment) * alignment
    return GGUFFile(path, metadata, _check_layout(gguf, infos, data_start, alignment, len(buf), path), buf)


def _value(cursor: _Cursor, key: str) -> Any:
    kind = cursor.unpack("<I", 4, f"the type of {key!r}")
    if kind == _STRING:
        return cursor.string(f"metadata {key}")
    if kind in _SCALARS:
        _, fmt, size = _SCALARS[kind]
        return cursor.unpack(fmt, size, f"metadata {key}")
    if kind != _ARRAY:
        raise ValueError(f"GGUF metadata {key}: value type {kind} is unknown; expected one of 0-12")
    item_type = cursor.unpack("<I", 4, f"the item type of {key!r}")
    if item_type == _ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array of arrays; expected an array of numbers or strings")
    if item_type != _STRING and item_type not in _SCALARS:
        raise ValueError(f"GGUF metadata {key}: array item type {item_type} is unknown; expected one of 0-8, 10-12")
    count = cursor.count(f"metadata {key} array length", 8 if item_type == _STRING else _SCALARS[item_type][2])
    array = GGUFArray(key, item_type, count, cursor.buf, cursor.offset)
    if item_type != _STRING:
        cursor.offset += count * _SCALARS[item_type][2]
        return array
    for index in range(count):  # strings vary in length: walk them (without decoding) to find the end
        length = cursor.count(f"metadata {key}[{index}] length", 1)
        cursor.offset += length
    return array


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"tensor #{index}'s name")
    n_dims = cursor.unpack("<I", 4, f"tensor {name!r}'s n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"GGUF tensor {name!r}: n_dims={n_dims}, expected 1 to {MAX_DIMS}")
    dims = tuple(cursor.unpack("<Q", 8, f"tensor {name!r}'s dims") for _ in range(n_dims))
    type_id = cursor.unpack("<I", 4, f"tensor {name!r}'s type")
    offset = cursor.unpack("<Q", 8, f"tensor {name!r}'s offset")
    return name, dims, type_id, offset


def _check_layout(
    gguf: Any, infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int, alignment: int, size: int,
    path: Path,
) -> dict[str, TensorInfo]:
    """Each tensor's type, dims, offset and byte size checked, and no two tensors' bytes overlapping."""
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise ValueError(f"GGUF tensor {name!r} is described twice; expected each name once")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r}: type id {type_id} is not a ggml type") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if any(d < 1 for d in dims) or dims[0] % block:
            raise ValueError(f"GGUF tensor {name!r}: dims {list(dims)} (fastest first) must be positive, the first a "
                             f"multiple of {qtype.name}'s block of {block}")
        elements = int(np.prod(dims, dtype=object))  # Python ints: no overflow
        nbytes = elements // block * block_bytes
        if offset % alignment:
            raise ValueError(f"GGUF tensor {name!r}: offset={offset} is not a multiple of "
                             f"general.alignment={alignment}")
        if offset + nbytes > data_size:
            raise ValueError(
                f"GGUF tensor {name!r}: offset={offset} + {nbytes} bytes ({qtype.name} {list(dims)}) runs past the "
                f"data section, which holds {max(data_size, 0)} bytes of {str(path)!r}"
            )
        tensors[name] = TensorInfo(name, qtype.name, type_id, dims, data_start + offset, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: (t.start, t.nbytes))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.start < before.start + before.nbytes:
            raise ValueError(
                f"GGUF tensors {before.name!r} (offset {before.start - data_start}, {before.nbytes} bytes) and "
                f"{after.name!r} (offset {after.start - data_start}) overlap; expected each tensor in its own bytes"
            )
    return tensors
