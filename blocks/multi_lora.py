"""Many LoRA adapters in one batch: each token adds the low-rank update of its own adapter (Punica, S-LoRA).

A layer that may be adapted gets a ``LoRASlots`` bank: ``n_slots`` fixed places, each holding one adapter's
``Aᵀ (in, max_rank)`` and ``(B · scaling)ᵀ (max_rank, out)`` — zero-padded to the bank's ``max_rank``, with the real
rank kept beside them (``ranks``, 0 where the slot's adapter leaves this layer alone). Loading an adapter copies into
its slot in place, so the tensors a compiled graph reads stay the same objects: nothing recompiles.

The batch's tokens are routed once per step by a ``LoRARouting`` (one per model, shared by its banks): the tokens
sorted by slot (``order``, ``offsets``), the same tokens laid out in a ``(slots, longest)`` block (``padded``), and
each sorted token's row in that block (``cells``), and the same segments as Python numbers. Each bank's hook then
adds its layer's updates: Punica's segmented products (one pair per slot present) or two batched products over all
slots, whichever costs less for that layer and step. In eager steps that choice and the segments it needs are worked
out once per step for all layers of equal ranks and width (``LoRARouting.plan``), not once per layer. A compiled
step sees one opaque call per layer (``blocks.lora_kernels.slot_lora``, a custom op) whatever the routing: the
routing and the adapters are its inputs, never a reason to recompile.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .adapters import ADAPTED_LAYERS, adapter_placement
from .lora_kernels import (
    KERNELS,
    Plan,
    Workspace,
    add_planned_lora_,
    add_slot_lora_,
    grouped_lora,
    plan_update,
    slot_lora,
)
from .quantized import QuantizedLinear

__all__ = ["LoRARouting", "LoRASlots", "attach_slots", "grouped_lora", "lora_layers", "slot_lora"]


class LoRARouting:
    """Which tokens of the current batch belong to which slot, shared by every ``LoRASlots`` of one model.

    Every tensor keeps its size and is written in place (a compiled graph reads them as the same inputs, with
    static shapes: module attributes are not made dynamic). Of a batch of ``T`` tokens, ``n`` of them adapted:
    ``order[:n]`` holds the adapted tokens sorted by slot and ``offsets`` the slots' segments in it; for the batched
    products, ``padded[s * L + j]`` is slot ``s``'s ``j``-th token (``L = longest``, the largest count; token 0 past a
    slot's count) and ``cells[k]`` the block row of ``order[k]``. ``workspace`` is the layers' shared scratch memory.
    ``bounds`` (``offsets`` as a list) and ``count`` (``longest`` as an int) serve eager steps, whose layers share
    their plans through ``plan`` (forgotten at each ``route``).

    Args:
        n_slots: the banks' slot count.
        capacity: tokens in one batch at most.
        device: where the tokens are (the index buffers live there; ``offsets`` and ``longest`` stay on the CPU,
            read by the op).
    """

    def __init__(self, n_slots: int, capacity: int, device: torch.device) -> None:
        self.n_slots, self.capacity, self.device = n_slots, capacity, device
        self.order = torch.zeros(capacity, dtype=torch.long, device=device)
        self.cells = torch.zeros(capacity, dtype=torch.long, device=device)
        self.padded = torch.zeros(n_slots * capacity, dtype=torch.long, device=device)
        self.offsets = torch.zeros(n_slots + 1, dtype=torch.long)
        self.longest = torch.zeros((), dtype=torch.long)
        self.workspace = Workspace()
        # the same routing as Python numbers, for eager steps, and each layer's plan, worked out once per step
        self.bounds, self.count = [0] * (n_slots + 1), 0
        self.plans: dict[tuple[Any, ...], Plan] = {}

    def route(self, token_slots: Sequence[int]) -> None:
        """Route a batch: the tokens sorted by slot and a few index tensors for the whole step, read by every layer.

        Args:
            token_slots: ``token_slots[t]`` is token ``t``'s slot, or -1 for the base model alone.

        Raises:
            ValueError: a slot outside ``[-1, n_slots)`` or more tokens than ``capacity``.
        """
        if len(token_slots) > self.capacity:
            raise ValueError(f"a batch of {len(token_slots)} tokens exceeds the routing's capacity={self.capacity}")
        members: list[list[int]] = [[] for _ in range(self.n_slots)]
        for t, slot in enumerate(token_slots):
            if 0 <= slot < self.n_slots:
                members[slot].append(t)
            elif slot != -1:
                raise ValueError(f"token slots must be in [-1, {self.n_slots}), got {sorted(set(token_slots))}")
        counts = [len(m) for m in members]
        self.bounds = [0, *itertools.accumulate(counts)]
        longest = self.count = max(counts)
        order = torch.tensor(list(itertools.chain.from_iterable(members)), dtype=torch.long)
        n = order.numel()
        if n == self.n_slots * longest:  # every slot has `longest` tokens: the block is the sorted tokens
            cells, padded = torch.arange(n), order
        else:  # slot s's j-th token sits at row s * longest + j of the block (token 0 in the padding)
            shift = torch.tensor([s * longest - lo for s, lo in enumerate(self.bounds[:-1])])
            cells = torch.arange(n) + shift.repeat_interleave(torch.tensor(counts), output_size=n)
            padded = torch.zeros(self.n_slots * longest, dtype=torch.long)
            padded[cells] = order
        self.offsets.copy_(torch.tensor(self.bounds))
        self.longest.fill_(longest)
        self.order[:n] = order.to(self.device, non_blocking=True)
        self.cells[:n] = cells.to(self.device, non_blocking=True)
        self.padded[:padded.numel()] = padded.to(self.device, non_blocking=True)
        self.plans.clear()

    def plan(self, rank: tuple[int, ...], width: int, kernel: str) -> Plan:
        """A layer's plan for this step (``blocks.lora_kernels.plan_update``), shared by layers of equal ranks and
        width: worked out once per step, not once per layer.

        Args:
            rank: the layer's slot ranks.
            width: its ``in + out`` features.
            kernel: ``"auto"``, ``"grouped"`` or ``"padded"``.

        Returns:
            The plan.

        Raises:
            ValueError: an unknown ``kernel``.
        """
        key = (rank, width, kernel)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = plan_update(rank, self.bounds, self.count, width, kernel)
        return plan


class LoRASlots:
    """A layer's adapter slots, run as a forward hook after the layer (``y = layer(x) + slot_lora(...)``).

    Args:
        in_features: the layer's input width.
        out_features: the layer's output width.
        n_slots: adapters it holds at once.
        max_rank: the rank every slot is padded to.
        routing: the model's token routing.
        device: where the slots live.
        dtype: the slots' dtype.

    Attributes:
        kernel: ``"auto"`` (the cheaper of the two per call), ``"grouped"`` or ``"padded"`` (``blocks.lora_kernels``).

    Shapes: a_t ``(n_slots, in, max_rank)``, b_t ``(n_slots, max_rank, out)``, ranks ``(n_slots,)``; ``a`` and ``b``
    are the same storage seen as ``(n_slots, max_rank, in)`` and ``(n_slots, out, max_rank)`` (``A``, ``B · scaling``).
    """

    def __init__(self, in_features: int, out_features: int, n_slots: int, max_rank: int, routing: LoRARouting,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        # stored transposed: each slot's products are then plain row-major GEMMs (batched ones read them in place)
        self.a_t = torch.zeros(n_slots, in_features, max_rank, device=device, dtype=dtype)
        self.b_t = torch.zeros(n_slots, max_rank, out_features, device=device, dtype=dtype)
        self.a, self.b = self.a_t.transpose(1, 2), self.b_t.transpose(1, 2)
        self.ranks = torch.zeros(n_slots, dtype=torch.long)
        self.rank_list = (0,) * n_slots  # the same, as Python numbers (eager steps' plans)
        self.views: list[tuple[Tensor, Tensor] | None] = [None] * n_slots  # each slot's weights at its rank
        self.routing = routing
        self.kernel = "auto"

    @torch.no_grad()
    def load(self, slot: int, a: Tensor | None, b: Tensor | None) -> None:
        """Put an adapter's ``A`` and scaled ``B`` into ``slot`` in place.

        Args:
            slot: which slot.
            a: the adapter's ``A`` on this layer, or None: the slot leaves this layer unchanged.
            b: its ``B`` times its scaling, or None.

        Raises:
            ValueError: shapes that do not fit the layer or a rank above ``max_rank``.

        Shapes: a ``(r, in_features)``, b ``(out_features, r)`` with ``r <= max_rank``.
        """
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()
        self.ranks[slot] = 0
        self.rank_list = tuple(self.ranks.tolist())
        self.views[slot] = None
        if a is None or b is None:
            return
        r = a.shape[0]
        if a.shape != (r, self.in_features) or b.shape != (self.out_features, r):
            raise ValueError(f"a LoRA of A {tuple(a.shape)} and B {tuple(b.shape)} does not fit a layer of "
                             f"{self.in_features} inputs and {self.out_features} outputs")
        if r > self.max_rank:
            raise ValueError(f"a LoRA of rank {r} does not fit slots of max_rank={self.max_rank}")
        self.a_t[slot, :, :r] = a.T.to(self.a_t)
        self.b_t[slot, :r] = b.T.to(self.b_t)
        self.ranks[slot] = r
        self.rank_list = tuple(self.ranks.tolist())
        self.views[slot] = (self.a_t[slot, :, :r], self.b_t[slot, :r])

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if self.kernel not in KERNELS:
            raise ValueError(f"LoRASlots.kernel must be one of {KERNELS}, got {self.kernel!r}")
        x, r = args[0], self.routing
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        if torch.compiler.is_compiling():
            y = slot_lora(flat_y, flat_x, self.a_t, self.b_t, self.ranks, r.order, r.offsets, r.cells, r.padded,
                          r.longest, self.kernel)
        elif torch.is_grad_enabled() and output.requires_grad:
            y = add_slot_lora_(flat_y.clone(), flat_x, self.a_t, self.b_t, self.ranks, r.order, r.offsets, r.cells,
                               r.padded, r.longest, self.kernel)
        else:  # eager inference: the step's plan, into the layer's fresh output, no custom-op dispatch
            plan = r.plan(self.rank_list, self.in_features + self.out_features, self.kernel)
            if plan[0] == "none":
                return output
            y = add_planned_lora_(flat_y, flat_x, self.a_t, self.b_t, plan, r.bounds[-1], r.count, r.order,
                                  r.cells, r.padded, r.workspace, self.views)
        return y.reshape(output.shape)


def lora_layers(model: nn.Module) -> list[str]:
    """The layers of a decoder's blocks that batched adapters may sit on.

    Args:
        model: a decoder model whose blocks are ``model.layers``.

    Returns:
        The names of its float, quantized and adapted linear layers under ``layers.`` that see every token (not MoE
        experts, which see a routed subset, nor the ``base`` inside an adapted quantized layer).
    """
    modules = dict(model.named_modules())
    names = []
    for name, module in modules.items():
        parent = modules.get(name.rpartition(".")[0])
        if not name.startswith("layers.") or ".experts." in f"{name}." or isinstance(parent, ADAPTED_LAYERS):
            continue
        if isinstance(module, (nn.Linear, QuantizedLinear, *ADAPTED_LAYERS)):
            names.append(name)
    return names


def attach_slots(model: nn.Module, n_slots: int, max_rank: int, capacity: int) -> tuple[
        LoRARouting, dict[str, LoRASlots], list[Any]]:
    """Give every ``lora_layers`` layer of ``model`` a ``LoRASlots`` bank, run by a forward hook.

    Args:
        model: a decoder model whose blocks are ``model.layers``.
        n_slots: adapters resident at once (>= 1).
        max_rank: the largest rank a slot holds (>= 1).
        capacity: tokens in one batch at most.

    Returns:
        The routing, the banks by layer name, and the hook handles (``handle.remove()`` detaches them).

    Raises:
        ValueError: a slot count, rank or capacity that is not a positive integer.
    """
    for label, value in (("n_slots", n_slots), ("max_rank", max_rank), ("capacity", capacity)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    names = lora_layers(model)
    modules = dict(model.named_modules())
    first = adapter_placement(modules[names[0]])[0] if names else torch.device("cpu")
    routing = LoRARouting(n_slots, capacity, first)
    banks, handles = {}, []
    for name in names:
        layer = modules[name]
        layer_device, layer_dtype = adapter_placement(layer)
        bank = LoRASlots(layer.in_features, layer.out_features, n_slots, max_rank, routing, layer_device,
                         layer_dtype)
        banks[name] = bank
        handles.append(layer.register_forward_hook(bank))
    return routing, banks, handles
