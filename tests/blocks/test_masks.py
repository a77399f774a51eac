"""Mask builders against brute-force loop definitions (True = may attend, causal aligned bottom-right)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import blocks
from tests import strategies as zst

lengths = st.integers(0, 12)
pos_lengths = st.integers(1, 12)


def loop_mask(lq: int, lk: int, allowed) -> torch.Tensor:  # noqa: ANN001
    return torch.tensor([[bool(allowed(i, j)) for j in range(lk)] for i in range(lq)], dtype=torch.bool).reshape(
        lq, lk
    )


def test_every_registered_mask_has_a_strategy() -> None:
    assert set(blocks.names("mask")) == set(zst.MASK_STRATEGIES)


@given(lq=lengths, lk=lengths)
def test_causal_mask_is_bottom_right_aligned(lq: int, lk: int) -> None:
    expected = loop_mask(lq, lk, lambda i, j: j <= i + lk - lq)
    mask = blocks.causal_mask(lq, lk)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@given(lq=lengths)
def test_causal_mask_square_default_is_lower_triangular(lq: int) -> None:
    assert torch.equal(blocks.causal_mask(lq), torch.ones(lq, lq, dtype=torch.bool).tril())


def test_causal_mask_examples() -> None:
    # Two queries after three cached keys see 4 and 5 keys; three queries over two keys: the first sees none.
    assert blocks.causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True] * 5]
    assert blocks.causal_mask(3, 2).tolist() == [[False, False], [True, False], [True, True]]


@given(lq=lengths, lk=lengths, window=st.integers(1, 14))
def test_sliding_window_mask(lq: int, lk: int, window: int) -> None:
    expected = loop_mask(lq, lk, lambda i, j: i + lk - lq - window < j <= i + lk - lq)
    assert torch.equal(blocks.sliding_window_mask(lq, lk, window=window), expected)


@given(lq=pos_lengths, lk=pos_lengths)
def test_sliding_window_mask_with_huge_window_is_causal(lq: int, lk: int) -> None:
    assert torch.equal(blocks.sliding_window_mask(lq, lk, window=lk + lq + 1), blocks.causal_mask(lq, lk))


@given(lq=lengths, lk=lengths, prefix=st.integers(0, 14))
def test_prefix_lm_mask_int(lq: int, lk: int, prefix: int) -> None:
    expected = loop_mask(lq, lk, lambda i, j: j < prefix or j <= i + lk - lq)
    assert torch.equal(blocks.prefix_lm_mask(lq, lk, prefix_len=prefix), expected)


@given(lq=pos_lengths, lk=pos_lengths, prefixes=st.lists(st.integers(0, 14), min_size=1, max_size=4))
def test_prefix_lm_mask_per_row_tensor(lq: int, lk: int, prefixes: list[int]) -> None:
    mask = blocks.prefix_lm_mask(lq, lk, prefix_len=torch.tensor(prefixes))
    assert mask.shape == (len(prefixes), 1, lq, lk)
    for row, p in enumerate(prefixes):
        expected = loop_mask(lq, lk, lambda i, j, p=p: j < p or j <= i + lk - lq)
        assert torch.equal(mask[row, 0], expected)
        # Row by row, the tensor form agrees with the int form.
        assert torch.equal(mask[row, 0], blocks.prefix_lm_mask(lq, lk, prefix_len=p))


@given(data=st.data(), b=st.integers(1, 3), lq=pos_lengths, lk=pos_lengths)
def test_document_mask(data: st.DataObject, b: int, lq: int, lk: int) -> None:
    ids_q = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=lq, max_size=lq), min_size=b,
                                            max_size=b)))
    ids_k = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=lk, max_size=lk), min_size=b,
                                            max_size=b)))
    mask = blocks.document_mask(ids_q, ids_k)
    assert mask.shape == (b, 1, lq, lk) and mask.dtype == torch.bool
    for r in range(b):
        expected = loop_mask(lq, lk, lambda i, j, r=r: ids_q[r, i] == ids_k[r, j])
        assert torch.equal(mask[r, 0], expected)
    self_mask = blocks.document_mask(ids_k)
    for r in range(b):
        assert torch.equal(self_mask[r, 0], loop_mask(lk, lk, lambda i, j, r=r: ids_k[r, i] == ids_k[r, j]))


@given(data=st.data(), b=st.integers(1, 3), lk=pos_lengths)
def test_padding_mask(data: st.DataObject, b: int, lk: int) -> None:
    keep = data.draw(zst.padding_masks(b, lk))
    mask = blocks.padding_mask(keep)
    assert mask.shape == (b, 1, 1, lk)
    full = mask.expand(b, 2, 3, lk)
    for r in range(b):
        for j in range(lk):
            assert bool(full[r, 1, 2, j]) == bool(keep[r, j])


@given(data=st.data(), b=st.integers(1, 3), lq=pos_lengths, lk=pos_lengths)
def test_masks_combine_with_and(data: st.DataObject, b: int, lq: int, lk: int) -> None:
    causal = blocks.causal_mask(lq, lk)
    keep = data.draw(zst.padding_masks(b, lk))
    ids = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=lk, max_size=lk), min_size=b, max_size=b))
    ids_k = torch.tensor(ids)
    ids_q = ids_k[:, -lq:] if lq <= lk else torch.zeros(b, lq, dtype=torch.long)
    combined = causal & blocks.padding_mask(keep) & blocks.document_mask(ids_q, ids_k)
    assert combined.shape == (b, 1, lq, lk)
    for r in range(b):
        expected = loop_mask(
            lq, lk, lambda i, j, r=r: j <= i + lk - lq and keep[r, j] and ids_q[r, i] == ids_k[r, j]
        )
        assert torch.equal(combined[r, 0], expected)


@given(data=st.data(), shape=zst.attention_shapes())
def test_strategy_masks_broadcast_to_scores(data: st.DataObject, shape: zst.AttentionShape) -> None:
    mask = data.draw(zst.attention_masks(shape.b, shape.h, shape.lq, shape.lk, allow_none=False))
    assert mask.dtype == torch.bool
    assert torch.broadcast_shapes(mask.shape, shape.scores) == shape.scores


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: blocks.causal_mask(-1, 3), "-1"),
        (lambda: blocks.causal_mask(3, -2), "-2"),
        (lambda: blocks.sliding_window_mask(4, 4, window=0), "window"),
        (lambda: blocks.sliding_window_mask(4, 4, window=-3), "-3"),
        (lambda: blocks.prefix_lm_mask(4, 4, prefix_len=-1), "prefix_len"),
        (lambda: blocks.prefix_lm_mask(4, 4, prefix_len=torch.zeros(2, 2, dtype=torch.long)), r"\(2, 2\)"),
        (lambda: blocks.padding_mask(torch.ones(2, 3)), "float32"),
        (lambda: blocks.padding_mask(torch.ones(2, 3, 4, dtype=torch.bool)), r"\(2, 3, 4\)"),
        (lambda: blocks.document_mask(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)),
         r"\(3, 3\)"),
        (lambda: blocks.document_mask(torch.zeros(3, dtype=torch.long)), r"\(3,\)"),
    ],
)
def test_bad_mask_arguments_raise_value_error(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()
