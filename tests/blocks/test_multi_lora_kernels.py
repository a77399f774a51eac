"""``blocks.lora_kernels``: both ways of running per-token LoRA updates against a brute-force merged weight per row.

The reference for token ``t`` of adapter ``s`` is ``x[t] (W + scaleₛ Bₛ Aₛ)ᵀ`` — the adapter merged into the weight,
with peft's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rslora) — and ``x[t] Wᵀ`` for a token without one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from blocks.lora_kernels import KERNELS, Workspace, add_slot_lora_, choose_kernel, slot_lora
from blocks.multi_lora import LoRARouting, LoRASlots

MAX_RANK = 6


@st.composite
def batches(draw: st.DrawFn) -> dict:
    """Slots of random ranks (0: the adapter leaves this layer alone; some slots stay empty) and tokens of random
    slots, -1 (no adapter) included."""
    n_slots = draw(st.integers(1, 4))
    return dict(
        n_slots=n_slots,
        ranks=draw(st.lists(st.integers(0, MAX_RANK), min_size=n_slots, max_size=n_slots)),
        alphas=draw(st.lists(st.sampled_from([1.0, 4.0, 16.0]), min_size=n_slots, max_size=n_slots)),
        rslora=draw(st.lists(st.booleans(), min_size=n_slots, max_size=n_slots)),
        token_slots=draw(st.lists(st.integers(-1, n_slots - 1), min_size=1, max_size=24)),
        features=(draw(st.integers(1, 7)), draw(st.integers(1, 7))),
        seed=draw(st.integers(0, 2**16)),
        kernel=draw(st.sampled_from(KERNELS)),
    )


@settings(max_examples=25, deadline=None)
@given(batch=batches())
def test_every_token_equals_its_merged_weight(batch: dict) -> None:
    n_in, n_out = batch["features"]
    g = torch.Generator().manual_seed(batch["seed"])
    routing = LoRARouting(batch["n_slots"], capacity=32, device=torch.device("cpu"))
    bank = LoRASlots(n_in, n_out, batch["n_slots"], MAX_RANK, routing, torch.device("cpu"), torch.float64)
    bank.kernel = batch["kernel"]
    weight = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
    merged = []
    for slot, (r, alpha, rslora) in enumerate(zip(batch["ranks"], batch["alphas"], batch["rslora"], strict=True)):
        if r == 0:
            bank.load(slot, None, None)
            merged.append(weight)
            continue
        a = torch.randn(r, n_in, generator=g, dtype=torch.float64)
        b = torch.randn(n_out, r, generator=g, dtype=torch.float64)
        scale = alpha / (math.sqrt(r) if rslora else r)
        bank.load(slot, a, b * scale)
        merged.append(weight + scale * b @ a)
    tokens = batch["token_slots"]
    x = torch.randn(len(tokens), n_in, generator=g, dtype=torch.float64)
    routing.route(tokens)
    expected = torch.stack([x[t] @ (weight if s < 0 else merged[s]).T for t, s in enumerate(tokens)])

    with torch.no_grad():  # eager inference: in place into the layer's output, scratch memory reused
        eager = bank(nn.Identity(), (x,), x @ weight.T)
    compiled = slot_lora(x @ weight.T, x, bank.a_t, bank.b_t, bank.ranks, routing.order, routing.offsets,
                         routing.cells, routing.padded, routing.longest, batch["kernel"])  # the op compiled steps see
    torch.testing.assert_close(eager, expected)
    torch.testing.assert_close(compiled, expected)


def count_products(monkeypatch: pytest.MonkeyPatch, kernel: str, token_slots: list[int]) -> list[str]:
    """The matmul calls one layer makes for ``token_slots`` over 4 slots of rank 2 (slot 2 rank 0 here)."""
    routing = LoRARouting(4, capacity=16, device=torch.device("cpu"))
    bank = LoRASlots(3, 3, 4, max_rank=2, routing=routing, device=torch.device("cpu"), dtype=torch.float32)
    for slot in (0, 1, 3):
        bank.load(slot, torch.ones(2, 3), torch.ones(3, 2))
    routing.route(token_slots)
    calls = []
    mm, bmm = torch.mm, torch.bmm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: calls.append("mm") or mm(a, b, **kw))
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: calls.append("bmm") or bmm(a, b, **kw))
    y = add_slot_lora_(torch.zeros(len(token_slots), 3), torch.ones(len(token_slots), 3), bank.a_t, bank.b_t,
                       bank.ranks, routing.order, routing.offsets, routing.cells, routing.padded, routing.longest,
                       kernel, Workspace())
    adapted = [s in (0, 1, 3) for s in token_slots]
    torch.testing.assert_close(y, torch.tensor([[6.0] * 3 if a else [0.0] * 3 for a in adapted]))
    return calls


def test_grouped_runs_one_pair_per_slot_present_and_padded_two_products_in_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [0, 3, -1, 0, 2, 3, 0, -1]  # slot 1 absent, slot 2 present with rank 0 on this layer
    assert count_products(monkeypatch, "grouped", tokens) == ["mm"] * 4  # slots 0 and 3
    assert count_products(monkeypatch, "padded", tokens) == ["bmm"] * 2
    assert count_products(monkeypatch, "auto", [-1, 2]) == []  # nothing to add on this layer


def test_the_choice_follows_the_costs() -> None:
    """Decoding (a few tokens per adapter, all slots busy) batches; a long uneven prefill loops over segments."""
    decode = [8] * 8
    bounds = [0, *torch.tensor(decode).cumsum(0).tolist()]
    assert choose_kernel([16] * 8, bounds, 8, 256) == "padded"
    uneven = [400, 1, 1, 1, 1, 1, 1, 1]
    bounds = [0, *torch.tensor(uneven).cumsum(0).tolist()]
    assert choose_kernel([16] * 8, bounds, 400, 256) == "grouped"
    assert choose_kernel([0] * 8, bounds, 400, 256) == "none"
    with pytest.raises(ValueError, match="kernel must be one of"):
        add_slot_lora_(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1),
                       torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.tensor([0, 1]), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.tensor(1), "fast")


def test_workspace_views_do_not_overlap_and_the_buffer_is_reused() -> None:
    space = Workspace()
    like = torch.zeros(1)
    first = space.take([(2, 3), (4,)], like)
    for view, value in zip(first, (1.0, 2.0), strict=True):
        view.fill_(value)
    assert first[0].sum() == 6 and first[1].sum() == 8
    again = space.take([(5,)], like)
    assert again[0].data_ptr() == first[0].data_ptr()  # no new memory for a smaller request
    bigger = space.take([(20,)], like)
    assert bigger[0].numel() == 20
