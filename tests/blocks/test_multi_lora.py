"""``blocks.multi_lora``: the segmented LoRA products against a per-row brute force, one pair per slot present."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from blocks.multi_lora import LoRARouting, LoRASlots, attach_slots, grouped_lora


@settings(max_examples=8)
@given(slots=st.lists(st.integers(-1, 2), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_each_token_gets_its_own_slots_update(slots: list[int], seed: int) -> None:
    """``y + (x Aₛᵀ) Bₛᵀ`` per token of slot ``s``, ranks padded with zeros (slot 2 leaves the layer alone)."""
    g = torch.Generator().manual_seed(seed)
    routing = LoRARouting(3, capacity=16, device=torch.device("cpu"))
    bank = LoRASlots(5, 4, 3, max_rank=6, routing=routing, device=torch.device("cpu"), dtype=torch.float64)
    loras = [(torch.randn(r, 5, generator=g, dtype=torch.float64), torch.randn(4, r, generator=g,
                                                                              dtype=torch.float64)) for r in (2, 6)]
    for slot, (a, b) in enumerate(loras):
        bank.load(slot, a, b)
    bank.load(2, None, None)
    x = torch.randn(len(slots), 5, generator=g, dtype=torch.float64)
    y = torch.randn(len(slots), 4, generator=g, dtype=torch.float64)
    routing.route(slots)
    expected = y.clone()
    for t, s in enumerate(slots):
        if s in (0, 1):
            a, b = loras[s]
            expected[t] += b @ (a @ x[t])
    torch.testing.assert_close(bank(nn.Identity(), (x,), y), expected)


def test_one_pair_of_products_per_slot_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Punica's grouping: rows of one slot go through ``x Aᵀ`` and ``· Bᵀ`` together, wherever they sit."""
    routing = LoRARouting(4, capacity=16, device=torch.device("cpu"))
    bank = LoRASlots(3, 3, 4, max_rank=2, routing=routing, device=torch.device("cpu"), dtype=torch.float32)
    for slot in range(4):
        bank.load(slot, torch.ones(2, 3), torch.ones(3, 2))
    routing.route([0, 3, -1, 0, 3, 0, -1])  # slots 1 and 2 absent
    rows = []
    matmul, mm = torch.Tensor.__matmul__, torch.mm
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: rows.append(a.shape[0]) or matmul(a, b))
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: rows.append(a.shape[0]) or mm(a, b, **kw))
    grouped_lora(torch.zeros(7, 3), torch.ones(7, 3), bank.a, bank.b, bank.ranks, routing.order, routing.offsets)
    assert rows == [3, 3, 2, 2]


def test_bad_routing_and_shapes_are_refused() -> None:
    routing = LoRARouting(2, capacity=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"token slots must be in \[-1, 2\)"):
        routing.route([0, 2])
    with pytest.raises(ValueError, match="exceeds the routing's capacity=4"):
        routing.route([0] * 5)
    bank = LoRASlots(3, 3, 2, max_rank=2, routing=routing, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="rank 3 does not fit slots of max_rank=2"):
        bank.load(0, torch.ones(3, 3), torch.ones(3, 3))
    with pytest.raises(ValueError, match="does not fit a layer of 3 inputs"):
        bank.load(0, torch.ones(2, 4), torch.ones(3, 2))
    with pytest.raises(ValueError, match="n_slots must be a positive integer"):
        attach_slots(nn.Linear(2, 2), 0, 2, 4)



def test_the_step_is_planned_once_for_layers_alike_and_a_full_block_needs_no_reordering(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers of equal ranks and widths share one plan per step (``plan_update`` runs once per step, not per
    layer); a step where every slot has the same token count (decoding) still matches the brute force."""
    from blocks import lora_kernels

    g = torch.Generator().manual_seed(0)
    routing = LoRARouting(2, capacity=8, device=torch.device("cpu"))
    banks = [LoRASlots(3, 4, 2, max_rank=3, routing=routing, device=torch.device("cpu"), dtype=torch.float64)
             for _ in range(2)]
    loras = [[(torch.randn(r, 3, generator=g, dtype=torch.float64), torch.randn(4, r, generator=g,
                                                                               dtype=torch.float64)) for r in (3, 1)]
             for _ in banks]
    for bank, pair in zip(banks, loras, strict=True):
        for slot, (a, b) in enumerate(pair):
            bank.load(slot, a, b)
        bank.kernel = "padded"
    calls = []
    plan = lora_kernels.plan_update
    monkeypatch.setattr("blocks.multi_lora.plan_update", lambda *a: calls.append(a) or plan(*a))
    slots = [1, 0, 0, 1, -1, 1, 0]  # three tokens per slot: the batched block has no padding
    x = torch.randn(len(slots), 3, generator=g, dtype=torch.float64)
    for step in range(2):
        routing.route(slots)
        for bank, pair in zip(banks, loras, strict=True):
            y = torch.zeros(len(slots), 4, dtype=torch.float64)
            expected = torch.stack([torch.zeros(4, dtype=torch.float64) if s < 0 else pair[s][1] @ (pair[s][0] @ x[t])
                                    for t, s in enumerate(slots)])
            with torch.no_grad():
                torch.testing.assert_close(bank(nn.Identity(), (x,), y), expected)
        assert len(calls) == step + 1
