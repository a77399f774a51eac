"""The backends' mask and bias shape check agrees with ``torch.broadcast_shapes`` (the reference) on every shape."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks.backends.common import check_inputs

DIM = st.integers(1, 4)


@settings(max_examples=60, deadline=None)
@given(b=DIM, h=DIM, lq=DIM, lk=DIM, shape=st.lists(st.integers(1, 4), min_size=0, max_size=5),
       as_bias=st.booleans())
def test_mask_and_bias_shapes_are_accepted_exactly_when_they_broadcast(b: int, h: int, lq: int, lk: int,
                                                                       shape: list[int], as_bias: bool) -> None:
    q = torch.zeros(b, h, lq, 2)
    k = v = torch.zeros(b, h, lk, 2)
    full = (b, h, lq, lk)
    try:
        expected = len(shape) <= 4 and torch.broadcast_shapes(tuple(shape), full) == full
    except RuntimeError:
        expected = False
    t = torch.zeros(shape) if as_bias else torch.ones(shape, dtype=torch.bool)
    mask, bias = (None, t) if as_bias else (t, None)
    if expected:
        check_inputs(q, k, v, mask, bias)
    else:
        with pytest.raises(ValueError, match=re.escape(f"of shape {tuple(shape)} does not broadcast to")):
            check_inputs(q, k, v, mask, bias)
