"""The mixture-of-experts FFN against a per-token brute-force reference; its router, shared expert and losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.mixtral.modeling_mixtral as hf_mixtral
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import blocks
from blocks.moe import MixtureOfExperts, load_balancing_loss, router_loss, router_z_loss
from tests import strategies as zst

TOL = {"atol": 1e-5, "rtol": 1e-5}


def moe_reference(moe: nn.Module, x: Tensor) -> Tensor:
    """Token by token: softmax over the experts, the top-k kept (renormalised or not), their outputs summed with those
    weights, plus the (sigmoid-gated) shared expert."""
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(token @ moe.router.weight[:moe.n_experts].T, dim=-1)
        kept = sorted(range(moe.n_experts), key=lambda e: -probs[e].item())[:moe.top_k]
        weights = probs[kept] / probs[kept].sum() if moe.renormalize else probs[kept]
        out = sum(w * moe.experts[e](token) for w, e in zip(weights, kept, strict=True))
        if moe.shared_expert is not None:
            gate = torch.sigmoid(token @ moe.router.weight[-1]) if moe.shared_gate else 1.0
            out = out + gate * moe.shared_expert(token)
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


OPTIONS = [
    dict(n_experts=5, top_k=2),
    dict(n_experts=7, top_k=3, renormalize=False),
    dict(n_experts=4, top_k=1, expert="geglu", d_shared=6, shared_gate=True),
    dict(n_experts=3, top_k=3, d_shared=5, expert="gelu", bias=True),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@settings(max_examples=8)
@given(seed=zst.SEEDS, lead=st.lists(st.integers(1, 4), min_size=0, max_size=2))
@torch.no_grad()
def test_moe_equals_the_per_token_reference(options: dict, seed: int, lead: list[int]) -> None:
    torch.manual_seed(seed)
    moe = blocks.build("ffn", "moe", d_model=8, d_ff=12, **options).eval()
    x = zst.randn((*lead, 8), seed)
    torch.testing.assert_close(moe(x), moe_reference(moe, x), **TOL)


@torch.no_grad()
def test_the_compiled_path_equals_the_grouped_one() -> None:
    """Under torch.compile every expert runs on every token (static shapes), weighted 0 where not chosen."""
    torch.manual_seed(0)
    moe = blocks.build("ffn", "moe", d_model=8, d_ff=12, n_experts=5, top_k=2, d_shared=4, shared_gate=True).eval()
    x = torch.randn(3, 7, 8)
    compiled = torch.compile(moe, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), moe(x), **TOL)
    torch._dynamo.reset()


def test_gradients_reach_the_chosen_experts_and_the_router() -> None:
    torch.manual_seed(0)
    moe = blocks.build("ffn", "moe", d_model=8, d_ff=12, n_experts=6, top_k=2)
    x = torch.randn(1, 1, 8)
    moe(x).sum().backward()
    chosen = moe.router(x[0, 0]).topk(2).indices.tolist()
    touched = [e for e, expert in enumerate(moe.experts) if expert.up_proj.weight.grad.abs().sum() > 0]
    assert sorted(touched) == sorted(chosen)
    # The others get zero gradients, not none: data-parallel ranks reduce the same set (FSDP2 needs it).
    assert all(expert.up_proj.weight.grad is not None for expert in moe.experts)
    assert moe.router.weight.grad.abs().sum() > 0


def test_load_balancing_loss_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 9, 5, generator=gen) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    for m in (None, mask):
        expected = hf_mixtral.load_balancing_loss_func(logits, 5, 2, None if m is None else m.long())
        torch.testing.assert_close(load_balancing_loss(logits, 5, 2, m), expected, **TOL)
    # Perfect balance gives 1 · top_k... for uniform router probabilities the loss is top_k (f sums to top_k).
    uniform = (torch.zeros(10, 4),)
    torch.testing.assert_close(load_balancing_loss(uniform, 4, 2), torch.tensor(2.0))


def test_router_z_loss_is_the_mean_squared_logsumexp_over_real_tokens() -> None:
    logits = (torch.randn(6, 4), torch.randn(6, 4))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    real = mask.reshape(-1)
    expected = torch.cat([torch.logsumexp(h[real], -1) ** 2 for h in logits]).mean()
    torch.testing.assert_close(router_z_loss(logits, mask), expected, **TOL)


def test_router_loss_takes_the_recorded_logits_and_weights_them() -> None:
    torch.manual_seed(0)
    moes = [blocks.build("ffn", "moe", d_model=8, d_ff=4, n_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
            for _ in range(2)]
    x = torch.randn(2, 5, 8)
    h = moes[1](moes[0](x))
    logits = [m.router_logits for m in moes]
    assert logits[0].shape == (10, 4)
    expected = 0.1 * load_balancing_loss(logits, 4, 2) + 0.01 * router_z_loss(logits)
    loss = router_loss([nn.Identity(), *moes])
    torch.testing.assert_close(loss, expected)
    assert all(m.router_logits is None for m in moes)
    assert router_loss(moes) is None  # taken once
    (h.sum() + loss).backward()
    assert moes[0].router.weight.grad is not None
    moes[0](x)
    assert router_loss(moes[:1], compute=False) is None and moes[0].router_logits is None
    plain = blocks.build("ffn", "moe", d_model=8, d_ff=4)
    plain(x)
    assert router_loss([plain]) is None  # coefficients 0: no extra loss


def test_a_decoder_lm_adds_the_router_loss_with_labels_and_returns_it_in_training() -> None:
    import models

    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("mixtral-tiny", vocab_size=50)
    ids = torch.randint(0, 50, (2, 6))
    out = model(ids, labels=ids)
    logits = [layer.ffn.router_logits for layer in model.layers]
    assert logits == [None, None]
    model.eval()
    recorded: list[Tensor] = []
    for layer in model.layers:  # a hook sees the logits before the model's forward takes them
        layer.ffn.register_forward_hook(lambda module, args, out: recorded.append(module.router_logits))
    with torch.no_grad():
        lm = F.cross_entropy(model(ids).logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
        assert all(layer.ffn.router_logits is None for layer in model.layers)  # taken without labels too
        with_aux = model(ids, labels=ids).loss
    torch.testing.assert_close(with_aux, lm + 0.02 * load_balancing_loss(recorded[2:], 5, 2), **TOL)
    assert out.loss > 0 and out.aux_loss > 0
    with torch.no_grad():
        assert model(ids).aux_loss is None  # eval, no labels: not computed
        model.train()
        assert model(ids).aux_loss > 0  # training without labels (the Trainer's TokenLoss): returned


def test_a_compiled_model_gets_the_same_loss_router_loss_included() -> None:
    import models

    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("mixtral-tiny", vocab_size=50, n_layers=1).eval()
    ids = torch.randint(0, 50, (2, 6))
    run = lambda i: model(i, labels=i).loss  # noqa: E731
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(ids), run(ids), **TOL)
    assert model.layers[0].ffn.router_logits is None
    torch._dynamo.reset()


@pytest.mark.parametrize(("options", "message"), [
    (dict(n_experts=4, top_k=5), "top_k=5"),
    (dict(top_k=0), "top_k=0"),
    (dict(n_experts=0, top_k=1), "n_experts=0"),
    (dict(router="sigmoid"), "'sigmoid'"),
    (dict(expert="moe"), "expert='moe'"),
    (dict(expert="nope"), "expert='nope'"),
    (dict(d_shared=-1), "d_shared=-1"),
    (dict(shared_gate=True), "shared_gate"),
    (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(z_loss_coef=float("nan")), "z_loss_coef"),
])
def test_bad_options_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        blocks.build("ffn", "moe", d_model=8, d_ff=4, **options)


def test_a_config_validates_moe_options() -> None:
    import models

    with pytest.raises(ValueError, match="top_k=9"):
        models.DecoderLM(models.DecoderLMConfig(ffn="moe", options={"ffn": {"n_experts": 8, "top_k": 9}}))
    with pytest.raises(ValueError, match="n_expert"):
        models.DecoderLMConfig(ffn="moe", options={"ffn": {"n_expert": 8}})
    assert isinstance(models.DecoderLM(models.DecoderLMConfig(ffn="moe")).layers[0].ffn, MixtureOfExperts)
