"""``tokenization.string_table.StringTable``: a list of strings kept as UTF-8 bytes behaves as the list it was made
from (checked against the list itself), read from GGUF's length-prefixed layout too, and refuses bytes that are not
UTF-8 string by string."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenization.string_table import StringTable

# Text of every width (ASCII, Latin-1, BMP, astral), the empty string included.
strings = st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=6), max_size=12)


@given(strings, st.integers(-14, 14), st.integers(-14, 14))
def test_a_table_is_the_list_it_was_made_from(items, start, stop):
    table = StringTable(items)
    assert len(table) == len(items) and list(table) == items and table.tolist() == items
    assert table == items and table == tuple(items) and table == StringTable(items)
    assert [table[i] for i in range(-len(items), len(items))] == [items[i] for i in range(-len(items), len(items))]
    assert table[start:stop] == items[start:stop] and table[::-2] == items[::-2]
    assert (table == [*items, "x"]) is False
    encoded = [s.encode() for s in items]
    again = StringTable.from_utf8(b"".join(encoded), np.cumsum([0] + [len(b) for b in encoded]))
    assert again == table and again.nbytes == table.nbytes
    stored = b"head" + b"".join(struct.pack("<Q", len(b)) + b for b in encoded) + b"tail"  # GGUF's layout
    assert StringTable.from_length_prefixed(np.frombuffer(stored, np.uint8), 4, len(items)) == items
    for bad in (len(items), -len(items) - 1):
        with pytest.raises(IndexError, match=f"index {bad} is out of range"):
            table[bad]


@pytest.mark.parametrize(("data", "offsets", "index"), [
    (b"ok\xffno", [0, 2, 5], 1),  # a byte that starts no character
    (b"a\xc3\xa9", [0, 2, 3], 0),  # valid as a whole, but "é" cut in two: neither half is UTF-8
    (b"\xe2\x82", [0, 0, 2], 1),  # a truncated character at the end
])
def test_from_utf8_names_the_string_that_is_not_utf8(data, offsets, index):
    with pytest.raises(ValueError, match=rf"^GGUF tokens\[{index}\] is not valid UTF-8 \("):
        StringTable.from_utf8(data, np.array(offsets), "GGUF tokens")


def test_refusals():
    with pytest.raises(ValueError, match="offsets must rise from 0 to 3"):
        StringTable.from_utf8(b"abc", np.array([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="offsets must rise from 0 to 3"):
        StringTable.from_utf8(b"abc", np.array([0, 2]))
    with pytest.raises(TypeError, match="item 1 is int 7; expected a str"):
        StringTable(["a", 7])
    with pytest.raises(TypeError, match="indices must be integers or slices, not str"):
        StringTable(["a"])["0"]
