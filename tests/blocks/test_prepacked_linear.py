"""``blocks.prepacked_linear``: a float32 linear layer whose weight is held in oneDNN's blocked layout.

Checked against a float64 product of the original weights (an independent reference: neither oneDNN nor the
layout): any row count (none, one, the 16 the layout is chosen for, more), any width, with and without a bias, 3-d
inputs, eager, compiled and exported; ``nn.Linear``'s state-dict names and values; what ``prepack_linears`` packs
and what it leaves (a tied head, subclasses, hooked layers, other dtypes) and that it changes no output; the
custom op finds layers by handle and names a stale one; a build without oneDNN is refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from blocks import prepacked_linear
from blocks.prepacked_linear import PrepackedLinear, prepack_linears, prepackable
from models import DecoderLM
from serving.aot_export import tracing


def reference(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The product in float64 from the plain weight, rounded to float32."""
    bias = None if linear.bias is None else linear.bias.double()
    return nn.functional.linear(x.double(), linear.weight.double(), bias).float()


@settings(deadline=None, max_examples=25)
@given(rows=st.sampled_from([0, 1, 2, 5, 16, 17, 40]), d_in=st.integers(1, 70), d_out=st.integers(1, 70),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_product_equals_a_float64_product_of_the_plain_weight(rows: int, d_in: int, d_out: int, bias: bool,
                                                                   seed: int) -> None:
    torch.manual_seed(seed)
    linear = nn.Linear(d_in, d_out, bias=bias)
    layer = PrepackedLinear(linear)
    x = torch.randn(rows, d_in)
    got = layer(x)
    assert got.shape == (rows, d_out) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(linear, x), rtol=1e-5, atol=1e-5)
    assert layer._packed.is_mkldnn and not hasattr(layer, "weight")  # held in oneDNN's layout only


def test_3d_and_non_contiguous_inputs() -> None:
    linear = nn.Linear(24, 40)
    layer = PrepackedLinear(linear)
    x = torch.randn(3, 24, 7).transpose(1, 2)  # (3, 7, 24), not contiguous
    torch.testing.assert_close(layer(x), reference(linear, x), rtol=1e-5, atol=1e-5)


def test_the_state_dict_is_nn_linears_and_loading_one_repacks() -> None:
    linear, other = nn.Linear(12, 20), nn.Linear(12, 20)
    layer = PrepackedLinear(linear)
    state = layer.state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], linear.weight) and torch.equal(state["bias"], linear.bias)
    handle = layer.handle.clone()
    layer.load_state_dict(other.state_dict())
    x = torch.randn(4, 12)
    torch.testing.assert_close(layer(x), reference(other, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.handle, handle)  # still the same layer for compiled graphs
    with pytest.raises(RuntimeError, match=r"size mismatch for weight.*\(7, 12\)"):
        layer.load_state_dict({"weight": torch.zeros(7, 12), "bias": torch.zeros(20)})
    with pytest.raises(RuntimeError, match="Missing key.*weight"):
        layer.load_state_dict({"bias": torch.zeros(20)})


def test_other_weights_are_refused() -> None:
    with pytest.raises(ValueError, match=r"float32 CPU weight matrix, got torch.float64 \(3, 2\)"):
        PrepackedLinear(nn.Linear(2, 3).double())


def test_a_build_without_onednn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepacked_linear, "prepacking_available", lambda: False)
    with pytest.raises(RuntimeError, match="oneDNN"):
        PrepackedLinear(nn.Linear(2, 3))
    with pytest.raises(RuntimeError, match="oneDNN"):
        prepack_linears(nn.Sequential(nn.Linear(2, 3)))


class Scaled(nn.Linear):
    """A subclass of ``nn.Linear`` (as adapters are): its forward is its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_prepack_linears_packs_plain_layers_and_leaves_the_rest() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(11, 8)
    model.head = nn.Linear(8, 11, bias=False)
    model.head.weight = model.embed.weight  # tied: the embedding needs its rows
    model.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8, bias=False))
    model.scaled = Scaled(8, 8)
    model.hooked = nn.Linear(8, 8)
    model.hooked.register_forward_hook(lambda module, args, out: out + 1)
    model.wide = nn.Linear(8, 8).double()
    x = torch.randn(3, 8)

    def forward(m: nn.Module) -> torch.Tensor:
        h = m.body(m.embed(torch.tensor([1, 2, 3])))
        return torch.cat([m.head(h), m.scaled(x), m.hooked(x), m.wide(x.double()).float()], dim=1)

    want = forward(model)
    before = {name: t.data_ptr() for name, t in model.state_dict().items()}
    assert prepack_linears(model, min_elements=0) == ["body.0", "body.2"]
    assert [type(m) for m in model.body] == [PrepackedLinear, nn.ReLU, PrepackedLinear]
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight
    assert type(model.scaled) is Scaled and type(model.hooked) is nn.Linear and type(model.wide) is nn.Linear
    torch.testing.assert_close(forward(model), want, rtol=1e-5, atol=1e-5)
    # Every tensor left is in new memory (nothing keeps the old weights' memory alive), with its values.
    assert all(model.state_dict()[name].data_ptr() != ptr for name, ptr in before.items() if "body" not in name)


class Logits(nn.Module):
    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def test_a_decoder_runs_the_same_eager_compiled_and_exported() -> None:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("qwen3-tiny", n_layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        prepack_linears(model, min_elements=0)
        assert type(model.layers[0].self_attn.q_proj) is PrepackedLinear
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids).logits, want, rtol=1e-4, atol=1e-4)
        with tracing():
            program = torch.export.export(Logits(model), (ids,), strict=False)
    calls = [n for n in program.graph.nodes if n.target is torch.ops.zoo.prepacked_linear.default]
    assert len(calls) == sum(isinstance(m, PrepackedLinear) for m in model.modules()) > 0
    lifted = set(program.graph_signature.inputs_to_buffers.values())
    assert "model.layers.0.self_attn.q_proj.handle" in lifted
    assert not any(name.endswith("q_proj.weight") for name in program.state_dict)


def test_the_op_finds_layers_by_handle_and_names_a_missing_one() -> None:
    linear = nn.Linear(6, 4)
    layer = PrepackedLinear(linear)
    x = torch.randn(3, 6)
    torch.testing.assert_close(torch.ops.zoo.prepacked_linear(x, layer.handle, 4), reference(linear, x),
                               rtol=1e-5, atol=1e-5)
    stale = layer.handle.clone()
    del layer
    with pytest.raises(KeyError, match=f"no PrepackedLinear with handle {int(stale)}"):
        torch.ops.zoo.prepacked_linear(x, stale, 4)


def test_small_weights_stay_plain_by_default_and_named_layers_are_packed_exactly() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1023), nn.Linear(8, 8))
    assert prepacked_linear.MIN_ELEMENTS == 1024 * 1024
    assert prepackable(model) == ["0"] and prepackable(model, min_elements=8 * 8) == ["0", "1", "2"]
    assert prepack_linears(model) == ["0"]
    assert [type(m) for m in model] == [PrepackedLinear, nn.Linear, nn.Linear]
    other = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1023), nn.Linear(8, 8))
    assert prepack_linears(other, names=["2"]) == ["2"]
    assert [type(m) for m in other] == [nn.Linear, nn.Linear, PrepackedLinear]
    with pytest.raises(ValueError, match=r"not plain float32 linear layers of the model: \['2', 'nope'\]"):
        prepack_linears(other, names=["2", "nope"])


def test_a_meta_model_counts_as_it_would_load_and_is_not_packed() -> None:
    """``zoo serve`` reads a model onto the meta device for its config: ``prepackable`` names what loading it onto the
    CPU would pack (a tied head is told apart by identity there, having no memory), ``prepack_linears`` packs none."""
    with torch.device("meta"):
        meta = DecoderLM.from_preset("qwen3-tiny", n_layers=2)
    cpu = DecoderLM.from_preset("qwen3-tiny", n_layers=2)
    assert meta.lm_head.weight is meta.embed_tokens.weight and meta.lm_head.weight.is_meta
    names = prepackable(cpu, min_elements=0)
    assert prepackable(meta, min_elements=0) == names and len(names) == 7 * 2 and "lm_head" not in names
    assert prepack_linears(meta, min_elements=0) == []
    with pytest.raises(ValueError, match="not plain float32 linear layers of the model"):
        prepack_linears(meta, names=names[:1])
