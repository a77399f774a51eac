"""The ``int8`` and ``int4`` schemes against torchao, their independent reference.

References: torchao's quantized tensors (``Int8WeightOnlyConfig`` applied by ``quantize_``, ``Int4OpaqueTensor``
(its CPU int4 tensor), ``IntxUnpackedToInt8Tensor`` (its symmetric int4)) and primitives (``dequantize_affine``,
``_dequantize_affine_tinygemm``) for packing and unpacking; ``F.linear`` on the unpacked weight for the products;
``torch.equal`` for round trips. The int4 nibble layout is read back by index arithmetic written here from the
documented order, not by the layer's decoding.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchao.quantization.quant_primitives as ao
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torchao.prototype.quantization.int4 import Int4OpaqueTensor
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

import blocks
from blocks.quantized import Int4Linear, Int8Linear, quantize_linears, quantized_modules
from models import DecoderLM, DecoderLMConfig
from tests.models.test_kv_cache import build
from tests.strategies import SEEDS

pytestmark = pytest.mark.usefixtures("one_thread")

OUT_SIZES = st.sampled_from([1, 2, 3, 7, 16, 33])
GROUP_SIZES = st.sampled_from([32, 64, 128])
TINY = dict(vocab_size=64, d_model=64, n_heads=4, d_ff=128, max_len=32, dropout=0.0, n_layers=2)


def weights(out: int, width: int, seed: int, zero_row: bool = False) -> torch.Tensor:
    """A float32 ``(out, width)`` weight with rows of different magnitudes (one row of zeros if asked)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=g) * torch.rand(out, 1, generator=g) * 3
    if zero_row:
        w[0] = 0
    return w


def nibbles(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The ``(out, in)`` 4-bit values of an int4 ``qweight``, read by the documented layout: input ``k`` of group
    ``k // g`` sits in byte ``(k // g) · g/2 + k % (g/2)``, low nibble for the first half of the group."""
    k = torch.arange(qweight.shape[1] * 2)
    byte = k // group_size * (group_size // 2) + k % (group_size // 2)
    shift = 4 * (k % group_size >= group_size // 2)
    return ((qweight[:, byte].int() >> shift) & 15).int()


# ------------------------------------------------------------------------------------------ packing and unpacking
@given(out=OUT_SIZES, width=st.integers(1, 80), seed=SEEDS, zero_row=st.booleans())
def test_int8_packs_as_int8_weight_only_config_and_unpacks_as_dequantize_affine(
    out: int, width: int, seed: int, zero_row: bool
) -> None:
    w = weights(out, width, seed, zero_row)
    layer = Int8Linear.from_float(w)
    # torchao cannot take one input per row (it reduces a block of all ones over the whole tensor): a second copy
    # of the column has the same qparams.
    reference = nn.Sequential(nn.Linear(max(width, 2), out, bias=False))
    reference[0].weight.data = w.clone() if width > 1 else w.repeat(1, 2)
    quantize_(reference, Int8WeightOnlyConfig(set_inductor_config=False))
    packed = reference[0].weight
    assert torch.equal(layer.weight_int8, packed.qdata[:, :width]) and layer.weight_int8.dtype == torch.int8
    assert torch.equal(layer.scale, packed.scale.reshape(out)) and layer.scale.dtype == torch.float32
    expected = ao.dequantize_affine(packed.qdata, list(packed.block_size), packed.scale, None, torch.int8)
    assert torch.equal(layer.unpack(), expected[:, :width])
    assert torch.equal(layer.unpack(), packed.dequantize()[:, :width])


@given(out=OUT_SIZES, groups=st.integers(1, 3), group_size=GROUP_SIZES, seed=SEEDS, zero_row=st.booleans())
def test_int4_asymmetric_packs_and_unpacks_as_torchao_tinygemm(
    out: int, groups: int, group_size: int, seed: int, zero_row: bool
) -> None:
    w = weights(out, groups * group_size, seed, zero_row)
    layer = Int4Linear.from_float(w, group_size=group_size)
    # The arguments of torchao's CPU int4 tensor (Int4OpaqueTensor.from_hp; pinned by the next test).
    block = [1, group_size]
    scale, zero = ao._choose_qparams_affine_tinygemm(w, ao.MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                     None, torch.float32)
    q = ao._quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    assert torch.equal(nibbles(layer.qweight, group_size), q)
    assert torch.equal(layer.scale, scale.reshape(out, groups)) and torch.equal(layer.zero, zero.reshape(out, groups))
    reference = ao._dequantize_affine_tinygemm(q, block, scale, zero, torch.int32, 0, 15)
    assert torch.equal(layer.unpack(), reference)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (out, groups * group_size // 2)


def test_int4_asymmetric_matches_torchaos_cpu_int4_tensor() -> None:
    w = weights(32, 256, 0)
    layer = Int4Linear.from_float(w, group_size=64)
    reference = Int4OpaqueTensor.from_hp(w, [1, 64])
    assert torch.equal(reference.scale_and_zero, torch.stack([layer.scale.t(), layer.zero.t()], -1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles(layer.qweight, 64), 1)
    assert torch.equal(reference.qdata, packed)


@given(out=OUT_SIZES, groups=st.integers(1, 3), group_size=GROUP_SIZES, seed=SEEDS, zero_row=st.booleans())
def test_int4_symmetric_packs_and_unpacks_as_torchao_intx(
    out: int, groups: int, group_size: int, seed: int, zero_row: bool
) -> None:
    w = weights(out, groups * group_size, seed, zero_row)
    layer = Int4Linear.from_float(w, group_size=group_size, symmetric=True)
    reference = IntxUnpackedToInt8Tensor.from_hp(w, (1, group_size), torch.int4, mapping_type=ao.MappingType.SYMMETRIC)
    assert torch.equal(nibbles(layer.qweight, group_size) - 8, reference.qdata.int())
    assert torch.equal(layer.scale, reference.scale.reshape(out, groups))
    assert torch.equal(layer.zero, torch.zeros(out, groups))
    assert torch.equal(layer.unpack(), reference.dequantize())


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_error_is_within_half_a_step(symmetric: bool) -> None:
    w = weights(5, 128, 1)
    layer = Int4Linear.from_float(w, group_size=32, symmetric=symmetric)
    step = layer.scale.repeat_interleave(32, dim=1)
    # symmetric: the largest |w| of a group maps to 7.5 steps and is clipped to 7 (a half step)
    assert ((layer.unpack() - w).abs() <= step / 2 * (1 + 1e-5)).all()


# ------------------------------------------------------------------------------------------ products
def layers(seed: int) -> list[nn.Module]:
    w, b = weights(33, 128, seed), torch.randn(33, generator=torch.Generator().manual_seed(seed))
    return [Int8Linear.from_float(w, b), Int4Linear.from_float(w, b, group_size=32),
            Int4Linear.from_float(w, b, group_size=64, symmetric=True), Int4Linear.from_float(w, None)]


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_eager_products_equal_f_linear_on_the_unpacked_weight(rows: int) -> None:
    for layer in layers(rows):
        x = torch.randn(rows, 128)
        reference = F.linear(x.double(), layer.unpack().double(),
                             None if layer.bias is None else layer.bias.double())
        bound = 1e-5 * (x.abs().double() @ layer.unpack().abs().double().T + 1)
        assert ((layer(x).double() - reference).abs() <= bound).all(), layer
        assert layer(x[None]).shape == (1, rows, 33)
        ids = torch.tensor([[32, 0, 5], [5, 1, 32]])  # an embedding's gather: the rows of unpack()
        assert torch.equal(layer.embed(ids), layer.unpack()[ids])


def test_large_weights_are_multiplied_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import blocks.quantized.int4 as int4
    import blocks.quantized.int8 as int8

    monkeypatch.setattr(int8, "CHUNK_ELEMENTS", 128 * 8)  # int8 splits weights larger than this ...
    monkeypatch.setattr(int8, "EAGER_CHUNK", 128 * 4)  # ... into 4 output rows a chunk: 9 chunks of 33 rows
    monkeypatch.setattr(int4, "EAGER_CHUNK", 128 * 4)
    for layer in layers(0):
        x = torch.randn(5, 128)
        torch.testing.assert_close(layer(x), F.linear(x, layer.unpack(), layer.bias), rtol=1e-5, atol=1e-5)


def test_int4_bfloat16_product_takes_the_packed_kernel_within_bfloat16_rounding() -> None:
    for layer in layers(2)[1:]:
        x = torch.randn(3, 128)
        y = layer(x.bfloat16())
        assert y.dtype == torch.bfloat16
        reference = F.linear(x, layer.unpack(), layer.bias)
        assert (y.float() - reference).abs().max() <= 2e-2 * reference.abs().max()
    # The kernel has no backward: an input that needs gradients (an adapter's) takes BLAS.
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad.float(), layer.unpack().sum(0).expand(3, -1), rtol=2e-2, atol=2e-2)


def test_compiled_products_fuse_the_unpacking_and_equal_f_linear() -> None:
    from torch._inductor.utils import run_and_get_code

    int8, int4 = layers(3)[:2]
    x = torch.randn(3, 128)
    for layer in (int8, int4):
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)
        with torch.no_grad():
            y, code = run_and_get_code(compiled, x)
        torch.testing.assert_close(y, F.linear(x, layer.unpack(), layer.bias), rtol=1e-5, atol=1e-5)
        # Only the output is written: no buffer holds an unpacked weight (or its nibbles, half its elements).
        shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", "\n".join(code))
        assert shapes and all(eval(s.replace(", ", "*").strip(",")) < 33 * 128 // 2 for s in shapes), shapes
    with torch.no_grad():  # unpacking inside a compiled graph gives the same bits
        assert torch.equal(torch.compile(int4.unpack, fullgraph=True)(), int4.unpack())


# ------------------------------------------------------------------------------------------ state and caches
@pytest.mark.parametrize("options", [{}, {"group_size": 32}, {"group_size": 128, "symmetric": True}])
def test_state_dict_round_trips_bit_identically(options: dict) -> None:
    scheme = "int4" if options else "int8"
    source = blocks.get("quantization", scheme).from_float(weights(5, 256, 4), torch.randn(5), **options)
    state = source.state_dict()
    assert set(state) == {*source.state_names, "bias"}
    target = blocks.get("quantization", scheme)(256, 5, **options)
    target.load_state_dict(state)
    assert all(torch.equal(v, target.state_dict()[k]) and v.dtype == target.state_dict()[k].dtype
               for k, v in state.items())
    x = torch.randn(2, 256)
    assert torch.equal(target(x), source(x)) and target.options() == source.options()


def test_int4_kernel_cache_is_not_state_and_follows_a_loaded_state_dict() -> None:
    first, second = (Int4Linear.from_float(weights(20, 64, seed), torch.randn(20), group_size=32) for seed in (5, 6))
    x = torch.randn(2, 64).bfloat16()
    before = first(x)  # builds the packed copy for the kernel
    assert set(first.state_dict()) == {"qweight", "scale", "zero", "bias"}
    first.load_state_dict(second.state_dict())
    assert torch.equal(first(x), second(x)) and not torch.equal(first(x), before)


# ------------------------------------------------------------------------------------------ models
def test_int4_decoder_saves_and_loads_bit_identically_with_its_options(tmp_path: Path) -> None:
    model = build(DecoderLM, DecoderLMConfig(**TINY), 0)
    assert model.quantize("int4", group_size=32) is model
    assert set(quantized_modules(model).values()) == {"int4"}
    folder = model.save_pretrained(tmp_path / "q")
    entry = json.loads((folder / "config.json").read_text())["quantization"]
    assert entry["scheme"] == "int4" and entry["options"] == {"group_size": 32, "symmetric": False}
    loaded = DecoderLM.from_pretrained(folder)
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert all(saved[k].dtype == back[k].dtype and torch.equal(saved[k], back[k]) for k in saved)
    assert all(m.options() == {"group_size": 32, "symmetric": False}
               for m in loaded.modules() if isinstance(m, Int4Linear))
    ids = torch.randint(4, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_group_size_that_does_not_divide_a_layer_refuses_the_whole_model() -> None:
    model = build(DecoderLM, DecoderLMConfig(**{**TINY, "d_model": 96, "d_ff": 128}), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot quantize layers\.0\.self_attn\.q_proj \(96 inputs\) as 'int4': "
                                         r"int4 needs in_features divisible by group_size: in_features 96 is not a "
                                         r"multiple of group_size 64"):
        model.quantize("int4", group_size=64)
    assert not quantized_modules(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"cannot quantize 1 \(96 inputs\) as 'int4'.*in_features 96 is not"):
        quantize_linears(nn.Sequential(nn.Linear(128, 4), nn.Linear(96, 4)), "int4", group_size=64,
                         modules=["1"])  # named layers only: "0" would fit


# ------------------------------------------------------------------------------------------ bad input
def test_bad_options() -> None:
    with pytest.raises(ValueError, match=r"int4 group_size must be one of \[32, 64, 128\], got 48"):
        Int4Linear(96, 4, group_size=48)
    with pytest.raises(ValueError, match=r"int4 group_size must be one of \[32, 64, 128\], got True"):
        Int4Linear(64, 4, group_size=True)
    with pytest.raises(ValueError, match=r"in_features 16 is not a multiple of group_size 32"):
        Int4Linear.from_float(torch.randn(4, 16), group_size=32)
    with pytest.raises(ValueError, match=r"in_features 16 is not a multiple of group_size 128"):
        Int4Linear(16, 4)  # the default group size
    with pytest.raises(ValueError, match=r"takes the options \['group_size', 'symmetric'\], got unknown \['bits'\]"):
        Int4Linear(64, 4, bits=4)
    with pytest.raises(ValueError, match=r"int4 symmetric must be True or False, got 'yes'"):
        Int4Linear(64, 4, symmetric="yes")
    with pytest.raises(ValueError, match=r"scheme 'int8' takes no options, got \['group_size'\]"):
        Int8Linear(64, 4, group_size=32)
    with pytest.raises(ValueError, match=r"expects inputs \(\.\.\., 64\), got \(2, 32\)"):
        Int4Linear(64, 4, group_size=32)(torch.randn(2, 32))


def test_torchao_is_needed_to_pack_only(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = {scheme: blocks.get("quantization", scheme).from_float(weights(4, 64, 7), **options)
              for scheme, options in (("int8", {}), ("int4", {"group_size": 32}))}
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without torchao imports
    x = torch.randn(2, 64)
    for scheme, layer in packed.items():
        options = layer.options()
        skeleton = blocks.get("quantization", scheme)(64, 4, bias=False, **options)
        skeleton.load_state_dict(layer.state_dict())
        assert torch.equal(skeleton(x), layer(x))
        with pytest.raises(ImportError, match=r"needs torchao: pip install 'transformer-zoo\[quant\]'"):
            blocks.get("quantization", scheme).from_float(torch.randn(4, 64), **options)
