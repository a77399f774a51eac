"""The small-row linear product used by compiled decoding: equal to ``F.linear``, routed only where it pays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from blocks.small_matmul import MAX_ROWS, SmallRowsLinear, small_rows_linear


@given(rows=st.integers(1, 12), d_in=st.integers(1, 40), d_out=st.integers(1, 40), bias=st.booleans(),
       lead=st.sampled_from([(), (1,), (2,)]), seed=st.integers(0, 2**16))
def test_equals_linear(rows: int, d_in: int, d_out: int, bias: bool, lead: tuple, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, d_in, generator=g)
    w, b = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g) if bias else None
    torch.testing.assert_close(small_rows_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_int8_weight_and_scale() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (24, 16), generator=g, dtype=torch.int8)
    scale, x = torch.rand(24, generator=g), torch.randn(3, 16, generator=g)
    expected = x.double() @ (q.double() * scale.double()[:, None]).T
    torch.testing.assert_close(small_rows_linear(x, q, scale=scale).double(), expected, rtol=1e-5, atol=1e-4)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"x \(\.\.\., 8\) .* got x \(2, 7\)"):
        small_rows_linear(torch.randn(2, 7), torch.randn(4, 8))
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=f"max_rows must be an int >= 0 or None, got {bad!r}"):
            SmallRowsLinear(bad)


def test_mode_routes_small_rows_without_grad_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import blocks.small_matmul as module

    real = module.small_rows_linear
    monkeypatch.setattr(module, "small_rows_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    layer = torch.nn.Linear(8, 4)
    with torch.no_grad(), SmallRowsLinear():
        small = layer(torch.randn(2, MAX_ROWS // 2, 8))
        layer(torch.randn(MAX_ROWS + 1, 8))
    with SmallRowsLinear():
        layer(torch.randn(1, 8))  # gradients wanted: F.linear
    assert calls == [(2, MAX_ROWS // 2, 8)]
    assert small.shape == (2, MAX_ROWS // 2, 4)


def test_compiled_model_under_the_mode_matches_eager() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()

    def step(x: torch.Tensor) -> torch.Tensor:
        with SmallRowsLinear():
            return model(x)

    compiled = torch.compile(step, backend="aot_eager", dynamic=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
