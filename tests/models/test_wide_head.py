"""``models.core.stack.head_logits`` multiplies a wide plain linear head in pieces in eager CPU inference: the same
logits as one product, and the one product wherever the pieces would change what runs."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from models.core import stack

CONFIG = types.SimpleNamespace(output_scale=1.0, logit_softcap=None)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The weight shape of every ``F.linear`` call."""
    seen: list[tuple[int, ...]] = []
    linear = nn.functional.linear

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(tuple(weight.shape))
        return linear(x, weight, bias)

    monkeypatch.setattr(nn.functional, "linear", counted)
    return seen


@pytest.mark.parametrize("bias", [False, True])
def test_a_wide_head_in_pieces_gives_the_logits_of_one_product(calls: list, bias: bool) -> None:
    torch.manual_seed(0)
    head = nn.Linear(24, stack.WIDE_HEAD + 700, bias=bias)  # a last piece shorter than the others
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        want = x @ head.weight.t() + (head.bias if bias else 0)
        got = stack.head_logits(CONFIG, head, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert len(calls) == -(-head.out_features // stack.HEAD_PIECE) == 17
    assert all(rows <= stack.HEAD_PIECE for rows, _ in calls)


def test_one_product_with_gradients_one_row_a_narrow_head_or_a_hook(calls: list) -> None:
    wide, narrow = nn.Linear(8, stack.WIDE_HEAD), nn.Linear(8, stack.WIDE_HEAD - 1)
    x = torch.randn(4, 8)
    stack.head_logits(CONFIG, wide, x)  # gradients on: training keeps the one product
    with torch.no_grad():
        stack.head_logits(CONFIG, wide, x[:1])
        stack.head_logits(CONFIG, narrow, x)
        hooked = []
        wide.register_forward_hook(lambda module, args, out: hooked.append(out.shape))
        stack.head_logits(CONFIG, wide, x)
    assert calls == [tuple(wide.weight.shape), tuple(wide.weight.shape), tuple(narrow.weight.shape),
                     tuple(wide.weight.shape)]
    assert hooked == [(4, stack.WIDE_HEAD)]
