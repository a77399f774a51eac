"""The hand-written CPU products of the 32-weight GGUF formats (``blocks.quantized.cpu_kernels``): each equals
``F.linear`` on the layer's unpacked weight (itself ``gguf.quants.dequantize`` bit for bit, tested in
``test_quantized_ggml.py``) up to float32 rounding, for any rows (passes of 8) and widths, eagerly and inside a
compiled graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
from blocks.quantized import cpu_kernels


def close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Within float32 rounding of the sum: |y - x·w| <= 1e-5 · (|x|·|w|), element-wise."""
    reference = F.linear(x.double(), w.double())
    bound = F.linear(x.abs().double(), w.abs().double())
    return bool(((y.double() - reference).abs() <= 1e-5 * bound + 1e-30).all())


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    # ggml_mm needs available() to have built the kernels; each xdist worker may start with any test of this file.
    cpu_kernels.available()


def test_the_kernels_are_built_here() -> None:
    # The test machine has a C++ compiler: the kernels must build (a failure is a bug, not a reason to skip).
    assert cpu_kernels.available()


@pytest.mark.parametrize("scheme", sorted(cpu_kernels.FORMATS))
@settings(max_examples=6)
@given(out=st.integers(1, 70), blocks_per_row=st.integers(1, 5), rows=st.integers(1, 19), seed=st.integers(0, 99))
def test_kernel_equals_linear_on_the_unpacked_weight(scheme: str, out: int, blocks_per_row: int, rows: int,
                                                     seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, 32 * blocks_per_row, generator=gen) * 0.05
    layer = blocks.get("quantization", scheme).from_float(weight)
    x = torch.randn(rows, 32 * blocks_per_row, generator=gen)
    packed = [getattr(layer, name) for name in cpu_kernels.FORMATS[scheme]]
    y = cpu_kernels.ggml_mm(x, scheme, packed)
    assert y.shape == (rows, out) and close(y, x, layer.unpack())
    # A layer's own forward takes the kernel for float32 inputs without gradients.
    with torch.no_grad():
        assert torch.equal(layer(x), y)


def test_the_kernel_inside_a_compiled_graph_and_its_limits() -> None:
    layer = blocks.get("quantization", "q4_1").from_float(torch.randn(40, 64) * 0.1)
    x = torch.randn(3, 64)
    packed = dict(layer.packed())
    assert cpu_kernels.usable("q4_1", x, packed)
    assert not cpu_kernels.usable("q4_1", x.bfloat16(), packed)  # float32 only
    assert not cpu_kernels.usable("q6_k", x, packed)  # not a format of the kernel
    with torch.enable_grad():
        assert not cpu_kernels.usable("q4_1", x.requires_grad_(), packed)  # no backward
    x = x.detach()
    compiled = torch.compile(lambda t: cpu_kernels.ggml_mm(t, "q4_1", [packed["d"], packed["m"], packed["qs"]]),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), cpu_kernels.ggml_mm(x, "q4_1", [packed["d"], packed["m"], packed["qs"]]))


def test_a_wide_head_and_many_rows() -> None:
    # 3 passes of up to 8 rows over a 2000-row weight split over threads: every output written once.
    layer = blocks.get("quantization", "q8_0").from_float(torch.randn(2000, 96) * 0.02)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((21, 96)).astype(np.float32))
    y = cpu_kernels.ggml_mm(x, "q8_0", [layer.d, layer.qs])
    assert close(y, x, layer.unpack())


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q5_0"])
@pytest.mark.parametrize("blocks_per_row", [15, 16, 17, 255, 256, 257, 273, 513])
def test_one_row_across_scale_chunks(scheme: str, blocks_per_row: int) -> None:
    # One input row takes the single-row path, which converts the scales in chunks of 256 blocks (16 at a time):
    # rows whose block count is not a multiple of either must still use each block's own scale.
    gen = torch.Generator().manual_seed(blocks_per_row)
    weight = torch.randn(5, 32 * blocks_per_row, generator=gen) * torch.rand(5, blocks_per_row, 1, generator=gen) \
        .expand(5, blocks_per_row, 32).reshape(5, -1)
    layer = blocks.get("quantization", scheme).from_float(weight)
    x = torch.randn(1, 32 * blocks_per_row, generator=gen)
    y = cpu_kernels.ggml_mm(x, scheme, [getattr(layer, name) for name in cpu_kernels.FORMATS[scheme]])
    assert close(y, x, layer.unpack())


@settings(max_examples=8)
@given(schemes=st.lists(st.sampled_from(sorted(cpu_kernels.FORMATS)), min_size=2, max_size=3),
       outs=st.lists(st.integers(1, 70), min_size=3, max_size=3), blocks_per_row=st.integers(1, 4),
       rows=st.sampled_from([1, 2, 9]), bias=st.booleans(), seed=st.integers(0, 99))
def test_joint_linear_equals_each_layer_alone(schemes: list[str], outs: list[int], blocks_per_row: int, rows: int,
                                              bias: bool, seed: int) -> None:
    # Layers of different formats and widths sharing one input (q/k/v, gate/up): one kernel call, each output the
    # same values as the layer's own call, written to its own columns.
    gen = torch.Generator().manual_seed(seed)
    width = 32 * blocks_per_row
    layers = []
    for scheme, out in zip(schemes, outs, strict=False):
        layer = blocks.get("quantization", scheme).from_float(
            torch.randn(out, width, generator=gen) * 0.05, bias=torch.randn(out, generator=gen) if bias else None)
        layers.append(layer)
    x = torch.randn(rows, 1, width, generator=gen)
    with torch.no_grad():
        joint = blocks.quantized.joint_linear(x, layers)
        assert joint is not None and len(joint) == len(layers)
        for layer, y in zip(layers, joint, strict=True):
            assert y.shape == (rows, 1, layer.out_features)
            assert torch.equal(y, layer(x))
            assert close(y.reshape(rows, -1) - (layer.bias if bias else 0), x.reshape(rows, width), layer.unpack())


def test_joint_linear_declines_what_it_cannot_multiply() -> None:
    q8 = blocks.get("quantization", "q8_0").from_float(torch.randn(8, 64))
    int8 = blocks.get("quantization", "int8").from_float(torch.randn(8, 64))
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert blocks.quantized.joint_linear(x, [q8]) is None  # one layer: nothing to join
        assert blocks.quantized.joint_linear(x, [q8, torch.nn.Linear(64, 8)]) is None  # not a block layer
        assert blocks.quantized.joint_linear(x, [q8, int8]) is None  # not a format of the kernel
        assert blocks.quantized.joint_linear(torch.randn(40, 64), [q8, q8]) is None  # more rows than KERNEL_ROWS
        handle = q8.register_forward_hook(lambda *args: None)
        assert blocks.quantized.joint_linear(x, [q8, q8]) is None  # a hook must see its call
        handle.remove()
        assert blocks.quantized.joint_linear(x, [q8, q8]) is not None
    assert blocks.quantized.joint_linear(x.requires_grad_(), [q8, q8]) is None  # no backward through the kernel


@pytest.mark.parametrize("call, message", [
    (lambda x, p: cpu_kernels.ggml_mm(x, "q9_0", p), r"scheme='q9_0'.*one of \['q8_0'"),
    (lambda x, p: cpu_kernels.ggml_mm(x, "q8_0", p[:1]), r"'q8_0' takes 2 packed tensors .*got 1"),
    (lambda x, p: cpu_kernels.ggml_mm(x, "q4_1", p), r"'q4_1' takes 3 packed tensors .*got 2"),
    (lambda x, p: cpu_kernels.ggml_mm(x.double(), "q8_0", p), r"x=\(2, 64\) torch.float64: expected a 2-d float32"),
    (lambda x, p: cpu_kernels.ggml_mm(x[:, :48], "q8_0", p), r"x=\(2, 48\).*multiple of 32"),
    (lambda x, p: cpu_kernels.ggml_mm(x[0], "q8_0", p), r"x=\(64,\)"),
    (lambda x, p: cpu_kernels.ggml_mm_joint(x, []), "at least one"),
    (lambda x, p: cpu_kernels.ggml_mm_joint(x, [("q8_0", p), ("nope", p)]), "scheme='nope'"),
])
def test_the_kernel_entry_points_name_bad_input(call, message: str) -> None:
    layer = blocks.get("quantization", "q8_0").from_float(torch.randn(8, 64))
    packed = [layer.d, layer.qs]
    with pytest.raises(ValueError, match=message):
        call(torch.randn(2, 64), packed)
