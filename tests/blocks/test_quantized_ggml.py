"""The GGUF block formats as ``quantization`` schemes: unpacking equals ``gguf.quants.dequantize`` bit for bit, the
state round-trips the file's bytes, and the linear (eager and compiled) and embedding forwards agree with the
unpacked weight."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
from blocks.quantized import QuantizedEmbedding
from blocks.quantized.ggml import GGMLLinear
from blocks.quantized.ggml_formats import SCHEMES
from tests.strategies import SEEDS

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = sorted(SCHEMES)
#: formats the gguf package quantizes (the K-quants have no quantizer there).
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def layer_class(ggml_type: str) -> type[GGMLLinear]:
    return blocks.get("quantization", SCHEMES[ggml_type])


def random_blocks(ggml_type: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random valid blocks: random bytes, every float16 field any finite value (normal, subnormal, zero, negative)."""
    cls = layer_class(ggml_type)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, cls.type_size), dtype=np.uint8)
    start = 0
    for _, size, dtype in cls.fields:
        if dtype == torch.float16:
            bits = raw[:, :, start:start + 2].copy().view(np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)  # exponent all ones (inf, nan): halve it
            raw[:, :, start:start + 2] = bits.view(np.uint8).reshape(rows, blocks_per_row, 2)
        start += size
    return raw.reshape(rows, -1)


def quantized_blocks(ggml_type: str, rows: int, blocks_per_row: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(float weight, its blocks by ``gguf.quants.quantize``), rows at different scales."""
    rng = np.random.default_rng(seed)
    cols = blocks_per_row * GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0]
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, size=(rows, 1))).astype(np.float32)
    return w, quantize(w, GGMLQuantizationType[ggml_type])


@st.composite
def raw_blocks(draw: st.DrawFn, ggml_type: str) -> np.ndarray:
    """Blocks of ``ggml_type``: 1, an odd number or several rows, one to three blocks per row; quantized from floats
    where gguf can, random valid bytes otherwise (or as well)."""
    rows, per_row, seed = draw(st.sampled_from([1, 2, 3, 7, 9])), draw(st.integers(1, 3)), draw(SEEDS)
    if ggml_type in QUANTIZABLE and draw(st.booleans()):
        return quantized_blocks(ggml_type, rows, per_row, seed)[1]
    return random_blocks(ggml_type, rows, per_row, seed)


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns (so -0.0 and 0.0 differ)."""
    return np.ascontiguousarray(t.numpy() if isinstance(t, torch.Tensor) else t).view(np.int32)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# ---- the format table ------------------------------------------------------------------------------------------


def test_every_gguf_block_format_is_registered_with_ggufs_sizes() -> None:
    assert TYPES == ["Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    for ggml_type, scheme in SCHEMES.items():
        cls = blocks.get("quantization", scheme)
        assert scheme == ggml_type.lower() and cls.scheme == scheme and cls.ggml_type == ggml_type
        assert (cls.block_size, cls.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
        assert cls.state_names == tuple(name for name, _, _ in cls.fields)


# ---- unpacking -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES)
@settings(max_examples=15)
@given(data=st.data())
def test_unpack_equals_gguf_dequantize_bit_for_bit(ggml_type: str, data: st.DataObject) -> None:
    raw = data.draw(raw_blocks(ggml_type))
    expected = dequantize(raw, GGMLQuantizationType[ggml_type])
    layer = layer_class(ggml_type).from_blocks(torch.from_numpy(raw))
    assert layer.unpack().dtype == torch.float32
    np.testing.assert_array_equal(bits(layer.unpack()), bits(expected))
    rows = torch.tensor([raw.shape[0] - 1, 0])
    np.testing.assert_array_equal(bits(layer.unpack(rows)), bits(expected[[raw.shape[0] - 1, 0]]))


@pytest.mark.parametrize("ggml_type", TYPES)
@settings(max_examples=10)
@given(data=st.data())
def test_blocks_round_trip_byte_for_byte(ggml_type: str, data: st.DataObject) -> None:
    raw = data.draw(raw_blocks(ggml_type))
    cls = layer_class(ggml_type)
    raw_t = torch.from_numpy(raw.copy())
    state = cls.blocks_to_state(raw_t)
    shapes = cls.packed_shapes(raw.shape[1] // cls.type_size * cls.block_size, raw.shape[0])
    assert list(state) == list(cls.state_names)
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == {k: (tuple(s), d) for k, (s, d) in
                                                                         shapes.items()}
    raw_t.fill_(0)  # the state is a copy, not a view of the file's bytes
    np.testing.assert_array_equal(cls.state_to_blocks(state).numpy(), raw)
    np.testing.assert_array_equal(cls.from_blocks(torch.from_numpy(raw)).to_blocks().numpy(), raw)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE)
def test_from_float_is_ggufs_quantizer(ggml_type: str) -> None:
    w, raw = quantized_blocks(ggml_type, 5, 2, seed=1)
    bias = torch.randn(5)
    layer = layer_class(ggml_type).from_float(torch.from_numpy(w), bias)
    np.testing.assert_array_equal(layer.to_blocks().numpy(), raw)
    np.testing.assert_array_equal(bits(layer.unpack()), bits(dequantize(raw, GGMLQuantizationType[ggml_type])))
    assert torch.equal(layer.bias, bias)
    assert layer.nbytes() == raw.nbytes + bias.numel() * 4


@pytest.mark.parametrize("ggml_type", sorted(set(TYPES) - set(QUANTIZABLE)))
def test_k_quants_refuse_to_quantize(ggml_type: str) -> None:
    with pytest.raises(ValueError, match=f"{ggml_type} can only be loaded from a GGUF file"):
        layer_class(ggml_type).from_float(torch.randn(2, 256))


def test_quantizing_without_gguf_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf.quants", None)
    with pytest.raises(ImportError, match=r"pip install 'transformer-zoo\[gguf\]'"):
        layer_class("Q8_0").from_float(torch.randn(2, 32))


# ---- products ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES)
@settings(max_examples=10)
@given(data=st.data(), n=st.sampled_from([1, 3, 17]), seed=SEEDS)
def test_eager_linear_equals_linear_on_the_unpacked_weight(ggml_type: str, data: st.DataObject, n: int,
                                                           seed: int) -> None:
    raw = data.draw(raw_blocks(ggml_type))
    layer = layer_class(ggml_type).from_blocks(torch.from_numpy(raw), bias=torch.randn(raw.shape[0]))
    x = torch.randn(n, layer.in_features, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = F.linear(x.double(), layer.unpack().double(), layer.bias.double())
        assert relative_error(layer(x), expected) < 1e-5
        assert relative_error(layer(x.view(1, n, -1))[0], expected) < 1e-5


def test_eager_linear_works_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import blocks.quantized.ggml as ggml
    from blocks.quantized import cpu_kernels

    monkeypatch.setattr(ggml, "EAGER_CHUNK", 64)  # two rows of 32 per chunk: three chunks, the last one short
    monkeypatch.setattr(cpu_kernels, "usable", lambda *args: False)  # the chunked path, not the kernel
    layer = layer_class("Q4_1").from_blocks(torch.from_numpy(random_blocks("Q4_1", 5, 1, seed=3)))
    x = torch.randn(2, 32)
    assert relative_error(layer.linear(x), x.double() @ layer.unpack().double().T) < 1e-5


def test_compiled_products_and_unpacking() -> None:
    """One inductor graph with every format: 1 and 3 rows fused into the reduction, and unpacking, bit for bit."""
    layers = [layer_class(t).from_blocks(torch.from_numpy(random_blocks(t, 5, 256 // layer_class(t).block_size, i)))
              for i, t in enumerate(TYPES)]

    def step(x1: torch.Tensor, x3: torch.Tensor, x17: torch.Tensor) -> list[torch.Tensor]:
        # 3 rows (fused, as 1 row) and 17 (unpacked chunks and BLAS) for two formats only: each product compiles
        # for a second.
        return [out for layer in layers for out in (
            layer.linear(x1), layer.unpack(), *((layer.linear(x3), layer.linear(x17))
                                                if layer.ggml_type in ("Q5_0", "Q4_K") else (None, None)))]

    xs = torch.randn(1, 256), torch.randn(3, 256), torch.randn(17, 256)
    with torch.no_grad():
        outs = torch.compile(step, backend="inductor", dynamic=False, fullgraph=True)(*xs)
    for i, layer in enumerate(layers):
        y1, w, y3, y17 = outs[4 * i:4 * i + 4]
        np.testing.assert_array_equal(bits(w), bits(layer.unpack()), err_msg=layer.scheme)
        for x, y in zip(xs, (y1, y3, y17), strict=True):
            if y is not None:
                assert relative_error(y, x.double() @ w.double().T) < 1e-5, layer.scheme


# ---- embedding and state -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES)
@settings(max_examples=5)
@given(data=st.data(), seed=SEEDS)
def test_embed_gathers_unpacked_rows(ggml_type: str, data: st.DataObject, seed: int) -> None:
    raw = data.draw(raw_blocks(ggml_type))
    table = layer_class(ggml_type).from_blocks(torch.from_numpy(raw))
    ids = torch.randint(0, raw.shape[0], (2, 3), generator=torch.Generator().manual_seed(seed))
    embedding = QuantizedEmbedding(table)
    np.testing.assert_array_equal(bits(embedding(ids)), bits(table.unpack()[ids]))
    assert embedding(ids[:0]).shape == (0, 3, table.in_features)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_state_dict_holds_the_packed_tensors_and_loads_bit_identically(ggml_type: str) -> None:
    cls = layer_class(ggml_type)
    raw = random_blocks(ggml_type, 3, 2, seed=7)
    layer = cls.from_blocks(torch.from_numpy(raw), bias=torch.randn(3))
    state = layer.state_dict()
    assert set(state) == {*cls.state_names, "bias"}
    fresh = cls(layer.in_features, 3)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(bits(fresh.unpack()), bits(layer.unpack()))
    np.testing.assert_array_equal(fresh.to_blocks().numpy(), raw)
    fresh.to(torch.bfloat16)  # a model cast leaves the format's float16 scales alone
    np.testing.assert_array_equal(fresh.to_blocks().numpy(), raw)
    assert set(cls(layer.in_features, 3, bias=False).state_dict()) == set(cls.state_names)


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q6_K"])
def test_bad_widths_and_options_are_refused(ggml_type: str) -> None:
    cls = layer_class(ggml_type)
    bad = cls.block_size + 16
    with pytest.raises(ValueError, match=rf"multiple of {cls.block_size}, got in_features={bad}"):
        cls(bad, 4)
    with pytest.raises(ValueError, match=rf"in_features={bad}"):
        cls.check_options(bad)
    with pytest.raises(ValueError, match="takes no options"):
        cls(cls.block_size, 4, group_size=32)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q5_K"])
def test_bad_blocks_are_refused(ggml_type: str) -> None:
    cls = layer_class(ggml_type)
    size = cls.type_size
    good = torch.from_numpy(random_blocks(ggml_type, 2, 1, seed=0))
    cases = [
        (good.to(torch.int8), rf"2-d uint8 tensor .* got torch.int8 \(2, {size}\)"),
        (good.reshape(-1), rf"2-d uint8 tensor .* got torch.uint8 \({2 * size},\)"),
        (torch.zeros(2, size + 1, dtype=torch.uint8),
         rf"shape \(2, {size + 1}\): .* multiple of the block's {size} bytes"),
        (torch.zeros(2, 0, dtype=torch.uint8), r"shape \(2, 0\)"),
        (torch.zeros(0, size, dtype=torch.uint8), rf"shape \(0, {size}\): expected at least one row"),
    ]
    for raw, message in cases:
        for call in (cls.blocks_to_state, cls.from_blocks):
            with pytest.raises(ValueError, match=message):
                call(raw)
    with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \(2,\), got torch.float32 \(3,\)"):
        cls.from_blocks(good, bias=torch.zeros(3))
    state = cls.blocks_to_state(good)
    with pytest.raises(ValueError, match="missing"):
        cls.state_to_blocks({k: v for k, v in list(state.items())[1:]})
    last = cls.state_names[-1]
    with pytest.raises(ValueError, match=rf"packed tensor {last!r}: expected"):
        cls.state_to_blocks({**state, last: state[last][:1]})
