"""Many LoRA adapters in one batch: each token adds the low-rank update of its own adapter (Punica, S-LoRA).

A layer that may be adapted gets a ``LoRASlots`` bank: ``n_slots`` fixed places, each holding one adapter's
``A (max_rank, in)`` and ``B · scaling (out, max_rank)`` — zero-padded to the bank's ``max_rank``, with the real rank
kept beside them (``ranks``, 0 where the slot's adapter leaves this layer alone). Loading an adapter copies into
its slot in place, so the tensors a compiled graph reads stay the same objects: nothing recompiles.

The batch's tokens are routed by a ``LoRARouting`` (one per model, shared by its banks): the tokens sorted by slot
(``order``) and where each slot's segment starts (``offsets``). ``grouped_lora`` — Punica's segmented
gather-matmul — then runs one pair of small products per slot present in the batch, not one per row: gather the
segment's inputs, ``x Aᵀ`` (rank-wide), ``· Bᵀ``, scatter-add into the base layer's output. It is a custom op
(``torch.library``), so a compiled step sees one opaque call per layer whatever the routing: the routing and the
adapters are its inputs, never a reason to recompile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .adapters import ADAPTED_LAYERS, adapter_placement
from .quantized import QuantizedLinear


@torch.library.custom_op("zoo::grouped_lora", mutates_args=())
def grouped_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, ranks: Tensor, order: Tensor,
                 offsets: Tensor) -> Tensor:
    """``y`` plus each token's LoRA update, grouped by slot (Punica's SGMV).

    Args:
        y: the base layer's output.
        x: the layer's input.
        a: the slots' ``A`` matrices, zero-padded to the bank's rank.
        b: the slots' ``B`` matrices times their scaling, zero-padded likewise.
        ranks: each slot's rank on this layer (CPU, int64; 0: no update).
        order: the adapted tokens' indices sorted by slot, then anything (a fixed-size buffer).
        offsets: where slot ``s``'s tokens are in ``order``: ``order[offsets[s]:offsets[s + 1]]`` (CPU, int64).

    Returns:
        ``y`` with ``(x[t] Aₛᵀ) Bₛᵀ`` added to every token ``t`` of slot ``s``.

    Shapes: y ``(T, out)``, x ``(T, in)``, a ``(S, R, in)``, b ``(S, out, R)``, ranks ``(S,)``, order ``(C,)``,
    offsets ``(S + 1,)`` -> ``(T, out)``.
    """
    out = y.clone()
    bounds, rank = offsets.tolist(), ranks.tolist()
    n = bounds[-1]
    if n == 0 or not any(rank):
        return out
    rows = order[:n]
    xs = x.index_select(0, rows).to(a.dtype)  # every adapted token, grouped by slot: one gather for the layer
    delta = xs.new_zeros(n, b.shape[1])
    for slot in range(len(rank)):
        lo, hi, r = bounds[slot], bounds[slot + 1], rank[slot]
        if hi > lo and r > 0:  # the segment's pair of products, at the adapter's own rank
            torch.mm(xs[lo:hi] @ a[slot, :r].T, b[slot, :, :r].T, out=delta[lo:hi])
    # index_put_ rather than index_add_: the latter takes ~0.2 s per call on some CPU builds (torch 2.13)
    out.index_put_((rows,), delta.to(out.dtype), accumulate=True)
    return out


@grouped_lora.register_fake
def _grouped_lora_fake(y: Tensor, x: Tensor, a: Tensor, b: Tensor, ranks: Tensor, order: Tensor,
                       offsets: Tensor) -> Tensor:
    return torch.empty_like(y)


class LoRARouting:
    """Which tokens of the current batch belong to which slot, shared by every ``LoRASlots`` of one model.

    Both tensors keep their size and are written in place (a compiled graph reads them as the same inputs, with
    static shapes: module attributes are not made dynamic): ``order[:n]`` holds the ``n`` adapted tokens sorted by
    slot, ``offsets`` the slots' segments in it.

    Args:
        n_slots: the banks' slot count.
        capacity: tokens in one batch at most.
        device: where the tokens are (``order`` lives there; ``offsets`` stays on the CPU, read by the op).
    """

    def __init__(self, n_slots: int, capacity: int, device: torch.device) -> None:
        self.n_slots, self.capacity, self.device = n_slots, capacity, device
        self.order = torch.zeros(capacity, dtype=torch.long, device=device)
        self.offsets = torch.zeros(n_slots + 1, dtype=torch.long)

    def route(self, token_slots: Sequence[int]) -> None:
        """Route a batch.

        Args:
            token_slots: ``token_slots[t]`` is token ``t``'s slot, or -1 for the base model alone.

        Raises:
            ValueError: a slot outside ``[-1, n_slots)`` or more tokens than ``capacity``.
        """
        slots = torch.as_tensor(list(token_slots), dtype=torch.long)
        if slots.numel() > self.capacity:
            raise ValueError(f"a batch of {slots.numel()} tokens exceeds the routing's capacity={self.capacity}")
        if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= self.n_slots):
            raise ValueError(f"token slots must be in [-1, {self.n_slots}), got {sorted(set(slots.tolist()))}")
        adapted = (slots >= 0).nonzero().flatten()
        order = adapted[torch.sort(slots[adapted], stable=True).indices]
        counts = torch.bincount(slots[adapted], minlength=self.n_slots)
        self.offsets[1:] = counts.cumsum(0)
        self.order[:order.numel()] = order.to(self.device, non_blocking=True)


class LoRASlots:
    """A layer's adapter slots, run as a forward hook after the layer (``y = layer(x) + grouped_lora(...)``).

    Args:
        in_features: the layer's input width.
        out_features: the layer's output width.
        n_slots: adapters it holds at once.
        max_rank: the rank every slot is padded to.
        routing: the model's token routing.
        device: where the slots live.
        dtype: the slots' dtype.

    Shapes: a ``(n_slots, max_rank, in)``, b ``(n_slots, out, max_rank)``, ranks ``(n_slots,)``.
    """

    def __init__(self, in_features: int, out_features: int, n_slots: int, max_rank: int, routing: LoRARouting,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        self.a = torch.zeros(n_slots, max_rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(n_slots, out_features, max_rank, device=device, dtype=dtype)
        self.ranks = torch.zeros(n_slots, dtype=torch.long)
        self.routing = routing

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
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0
        if a is None or b is None:
            return
        r = a.shape[0]
        if a.shape != (r, self.in_features) or b.shape != (self.out_features, r):
            raise ValueError(f"a LoRA of A {tuple(a.shape)} and B {tuple(b.shape)} does not fit a layer of "
                             f"{self.in_features} inputs and {self.out_features} outputs")
        if r > self.max_rank:
            raise ValueError(f"a LoRA of rank {r} does not fit slots of max_rank={self.max_rank}")
        self.a[slot, :r] = a.to(self.a)
        self.b[slot, :, :r] = b.to(self.b)
        self.ranks[slot] = r

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        x = args[0]
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        routing = self.routing
        y = grouped_lora(flat_y, flat_x, self.a, self.b, self.ranks, routing.order, routing.offsets)
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
