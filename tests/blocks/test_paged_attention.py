"""``blocks.paged_attention``: one-token rows over a paged pool without padding, against a brute-force softmax per
row and query head over the row's keys gathered position by position."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks.paged_attention import ragged_decode_attention
from blocks.paged_batch import PagedBatch


def brute_force(k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor, row: tuple[int, list[int]], scale: float,
                softcap: float | None, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``(Hkv, rep, Dv)``: each query head's softmax over the allowed positions of its row, in Python loops."""
    n_context, table = row
    bs, (n_kv, rep) = k_pool.shape[2], q.shape[:2]
    out = torch.zeros(n_kv, rep, v_pool.shape[-1], dtype=torch.float64)
    query = n_context - 1
    for h in range(n_kv):
        for r in range(rep):
            logits, values = [], []
            for pos in range(n_context):
                if window is not None and query - pos >= window:
                    continue
                key = k_pool[h, table[pos // bs], pos % bs].double()
                score = float(q[h, r].double() @ key) * scale
                logits.append(softcap * math.tanh(score / softcap) if softcap else score)
                values.append(v_pool[h, table[pos // bs], pos % bs].double())
            sink = [] if sinks is None else [float(sinks[h * rep + r])]
            top = max(logits + sink)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights) + sum(math.exp(x - top) for x in sink)
            out[h, r] = sum(w * v for w, v in zip(weights, values, strict=True)) / total
    return out


@settings(max_examples=25, deadline=None)
@given(contexts=st.lists(st.integers(1, 23), min_size=1, max_size=5), block_size=st.sampled_from([1, 2, 4, 8]),
       rep=st.sampled_from([1, 3]), window=st.none() | st.integers(1, 9), softcap=st.none() | st.floats(0.5, 30.0),
       sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_ragged_rows_equal_a_brute_force_softmax_per_row(contexts: list[int], block_size: int, rep: int,
                                                         window: int | None, softcap: float | None, sinks: bool,
                                                         seed: int) -> None:
    """Rows of any length (one block or many, the last one partly filled), scattered over the pool in any order,
    with GQA, a sliding window (whole blocks masked out), a soft-cap and sinks."""
    generator = torch.Generator().manual_seed(seed)
    n_kv, d = 2, 4
    used = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(used) + 3, generator=generator).tolist()  # scattered blocks, some never read
    tables = [order[sum(used[:i]):sum(used[:i + 1])] for i in range(len(used))]
    k_pool = torch.randn(n_kv, len(order), block_size, d, generator=generator) * 3
    v_pool = torch.randn(n_kv, len(order), block_size, d + 1, generator=generator)
    q = torch.randn(len(contexts), n_kv, rep, d, generator=generator)
    logits = torch.randn(n_kv * rep, generator=generator) * 3 if sinks else None
    rows = PagedBatch([(1, c, t) for c, t in zip(contexts, tables, strict=True)], block_size, decode="ragged").ragged
    got = ragged_decode_attention(k_pool, v_pool, q, rows, 0.7, softcap, window, logits)
    for i, row in enumerate(zip(contexts, tables, strict=True)):
        want = brute_force(k_pool, v_pool, q[i], row, 0.7, softcap, window, logits)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-5)


def test_entries_are_one_per_row_and_block_read() -> None:
    rows = PagedBatch([(1, 9, [7, 2, 5]), (1, 4, [3]), (2, 6, [0, 1])], 4, decode="ragged").ragged
    assert rows.block.tolist() == [7, 2, 5, 3] and rows.row.tolist() == [0, 0, 0, 1]
    assert rows.start.tolist() == [0, 4, 8, 0] and rows.layout.tolist() == [[0, 1, 2], [3, 4, 4]]
    assert rows.query.tolist() == [0, 1] and rows.q_pos.tolist() == [8, 3] and not rows.whole
