"""The engine's LoRA adapters: registered by name, resident in a bounded number of slots, routed per token.

``LoRARegistry`` puts ``blocks.multi_lora`` slot banks on every layer of the model that an adapter may adapt
(forward hooks: the model's modules, names and weights stay as they are). An adapter is read and checked against
the model when it is added (``add``: a ``peft`` folder or Hub repo, read by ``models.checkpoints.adapter_files``,
or LoRA blocks in memory); it enters a slot when a request that names it is scheduled (``admit``), taking a free
slot or the least recently used one that no running request needs; ``route`` tells the banks which tokens of a
step belong to which slot. Removing an adapter (``remove``) only stops new requests from naming it: requests
already queued keep their ``LoRAAdapter`` object, and with it the weights, until they end.

Every adapter has a ``cache_salt``, unique to this load of it, which seeds the prefix-cache keys of its requests:
a cached block is only ever reused by requests of the same adapter (or of none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from blocks.adapters import LoRA
from blocks.multi_lora import attach_slots
from models.checkpoints.adapter_files import read_adapter

from .requests import RequestSpec, Sequence

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")


@dataclasses.dataclass(eq=False)
class LoRAAdapter:
    """One loaded adapter: per adapted layer its ``A (r, in)`` and ``B · scaling (out, r)``.

    Attributes:
        name: what requests call it.
        source: where it came from (a folder, a Hub repo, or ``"<memory>"``).
        layers: zoo layer name -> ``(A, B · scaling)``.
        rank: the largest rank over its layers.
        cache_salt: seeds its requests' prefix-cache keys (unique to this load).
        slot: the slot holding it now, or None.
    """

    name: str
    source: str
    layers: dict[str, tuple[Tensor, Tensor]]
    rank: int
    cache_salt: bytes
    slot: int | None = None


def read_loras(model: nn.Module, source: Any, **options: Any) -> tuple[dict[str, Any], str]:
    """Read an adapter's LoRA blocks.

    Args:
        model: the base model.
        source: a ``peft`` folder or Hub repo, or LoRA blocks by layer name (see ``LoRARegistry.add``).
        options: ``revision``, ``model_type``, ``token``, ``endpoint`` for reading files.

    Returns:
        The LoRA blocks by layer name, and how to name the source.

    Raises:
        ValueError: the loader's refusals, or an adapter that saves a task head.
    """
    if isinstance(source, Mapping):
        return dict(source), "<memory>"
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"lora_path must be a folder or a Hub repo id, got {type(source).__name__}")
    where = os.fspath(source)
    loras, head = read_adapter(model, source, **options)
    if head:
        raise ValueError(f"adapter {where!r} saves the task head ({sorted(head)[:3]}...) as modules_to_save: a head "
                         "replaced per request cannot share a batch; serve it merged")
    return loras, where


class LoRARegistry:
    """The adapters an engine serves, and the slots that hold them.

    Args:
        model: the engine's ``DecoderLM`` (slot banks are hooked onto its layers).
        max_loras: adapters resident at once (slots; >= 1).
        max_rank: the largest rank an adapter may have (slots are this wide; >= 1).
        capacity: tokens in one step at most.

    Raises:
        ValueError: a bound that is not a positive integer.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, capacity: int) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.routing, self.banks, self.handles = attach_slots(model, max_loras, max_rank, capacity)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: list[LoRAAdapter | None] = [None] * max_loras
        self.used = [0] * max_loras  # when each slot was last admitted to (the LRU order)
        self._clock = itertools.count(1)
        self._loads = itertools.count()

    # ------------------------------------------------------------------------------------------- names
    def names(self) -> list[str]:
        """The adapters new requests may name.

        Returns:
            Their names, in the order they were added.
        """
        return list(self.adapters)

    def get(self, name: Any) -> LoRAAdapter:
        """The adapter called ``name``.

        Args:
            name: its name.

        Returns:
            The adapter.

        Raises:
            ValueError: no adapter of that name.
        """
        adapter = self.adapters.get(name) if isinstance(name, str) else None
        if adapter is None:
            raise ValueError(f"adapter={name!r} is not loaded; the loaded adapters are {self.names()}")
        return adapter

    def add(self, name: str, source: str | os.PathLike[str] | Mapping[str, LoRA], **options: Any) -> LoRAAdapter:
        """Read and check an adapter, and register it as ``name`` (it enters a slot when a request needs it).

        Args:
            name: what requests will call it (letters, digits and ``_ . : / -``; not in use).
            source: a folder or Hub repo with a ``peft`` LoRA (``adapter_config.json`` and its weights), or LoRA
                blocks by zoo layer name (as ``models.checkpoints.peft_lora.zoo_adapters`` returns them).
            options: ``revision``, ``model_type``, ``token``, ``endpoint`` for reading files.

        Returns:
            The registered adapter.

        Raises:
            ValueError: a bad or used name; an adapter that does not fit the model (the loader's refusals: other
                modules or shapes, an unsupported config), that adapts a layer the engine cannot batch (outside the
                decoder layers, MoE experts), saves a task head, or has a rank above ``max_rank``. The registry is
                unchanged then.
            FileNotFoundError: a folder without the adapter files.
        """
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"lora_name must be 1-128 letters, digits or '_.:/-' starting with a letter or digit, "
                             f"got {name!r}")
        if name in self.adapters:
            raise ValueError(f"lora_name={name!r} is already loaded; unload it first")
        loras, where = read_loras(self.model, source, **options)
        layers = self.check(loras, where)
        salt = hashlib.sha256(f"lora:{next(self._loads)}:{name}:{where}".encode()).digest()
        rank = max((a.shape[0] for a, _ in layers.values()), default=0)
        adapter = LoRAAdapter(name, where, layers, rank, salt)
        self.adapters[name] = adapter
        return adapter

    def check(self, loras: Mapping[str, Any], where: str) -> dict[str, tuple[Tensor, Tensor]]:
        """Check LoRA blocks against the slot banks.

        Args:
            loras: LoRA blocks by layer name.
            where: the adapter's source, for the messages.

        Returns:
            ``(A, B · scaling)`` per layer.

        Raises:
            ValueError: no layer adapted, a block that is not a LoRA, a layer without a bank, shapes that differ
                from the layer's, a rank above ``max_rank``.

        Shapes: A ``(r, in)``, B ``(out, r)``.
        """
        if not loras:
            raise ValueError(f"adapter {where!r} adapts no layer")
        layers = {}
        for layer, lora in loras.items():
            if not isinstance(lora, LoRA):
                raise ValueError(f"adapter {where!r}: {layer!r} holds a {type(lora).__name__}; expected LoRA blocks")
            bank = self.banks.get(layer)
            if bank is None:
                raise ValueError(f"adapter {where!r} adapts {layer!r}, which the engine cannot batch adapters on; "
                                 f"adaptable layers are the linear layers of the decoder blocks such as "
                                 f"{sorted(self.banks)[:4]} (not MoE experts nor the output layer)")
            a, b = lora.lora_A.detach(), lora.lora_B.detach() * lora.scaling
            if a.shape[1] != bank.in_features or b.shape[0] != bank.out_features:
                raise ValueError(f"adapter {where!r}: the LoRA of {layer!r} maps {a.shape[1]} -> {b.shape[0]} "
                                 f"features; the layer maps {bank.in_features} -> {bank.out_features}")
            if a.shape[0] > self.max_rank:
                raise ValueError(f"adapter {where!r} has rank {a.shape[0]} on {layer!r}, above max_lora_rank="
                                 f"{self.max_rank}; start the engine with a larger max_lora_rank")
            layers[layer] = (a.clone(), b.clone())
        return layers

    def remove(self, name: str) -> LoRAAdapter:
        """Stop serving ``name`` to new requests; requests that use it already keep it until they end (its slot is
        reused once none needs it).

        Args:
            name: the adapter's name.

        Returns:
            The removed adapter.

        Raises:
            ValueError: no adapter of that name.
        """
        adapter = self.get(name)
        del self.adapters[name]
        return adapter

    # ------------------------------------------------------------------------------------------- slots
    def acquire(self, adapter: LoRAAdapter, busy: Iterable[LoRAAdapter | None]) -> bool:
        """Make ``adapter`` resident: keep its slot, or load it into a free slot or the least recently used one
        that no adapter in ``busy`` holds.

        Args:
            adapter: the adapter a request needs.
            busy: the adapters of the running requests (their slots stay).

        Returns:
            Whether it is resident; False when every slot is busy (the request waits).
        """
        if adapter.slot is None:
            held = {a.slot for a in busy if a is not None and a.slot is not None}
            free = [s for s in range(self.max_loras) if s not in held]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.used[s]))
            old = self.slots[slot]
            if old is not None:
                old.slot = None
            for layer, bank in self.banks.items():
                bank.load(slot, *adapter.layers.get(layer, (None, None)))
            self.slots[slot], adapter.slot = adapter, slot
        self.used[adapter.slot] = next(self._clock)
        return True

    def admitter(self, running: Callable[[], Iterable[Sequence]]) -> Callable[[Sequence], bool]:
        """The scheduler's ``admit`` test: a waiting sequence may start once its adapter is resident.

        Args:
            running: returns the running sequences.

        Returns:
            The test, ``admit(sequence) -> bool``.
        """
        def admit(seq: Sequence) -> bool:
            adapter = seq.spec.adapter
            return adapter is None or self.acquire(adapter, (s.spec.adapter for s in running()))
        return admit

    def route(self, scheduled: Iterable[tuple[Sequence, int]]) -> None:
        """Route one step's tokens to their adapters' slots.

        Args:
            scheduled: ``(sequence, new tokens)`` in batch order.

        Raises:
            RuntimeError: a sequence whose adapter is not resident (``admit`` rules it out).
        """
        slots: list[int] = []
        for seq, n in scheduled:
            adapter = seq.spec.adapter
            slot = -1 if adapter is None else adapter.slot
            if slot is None:  # admit loads every adapter before its sequence runs
                raise RuntimeError(f"adapter {adapter.name!r} of request {seq.request_id} is not resident")
            slots += [slot] * n
        self.routing.route(slots)


class LoRAEngineMixin:
    """What ``serving.Engine`` does with adapters: ``add_lora``, ``remove_lora``, ``lora_names``; the engine calls
    ``enable_loras`` when built, ``with_adapter`` on each request and ``route_loras`` before each forward pass."""

    loras: LoRARegistry | None = None

    def enable_loras(self, max_loras: int, max_lora_rank: int | None, loras: Mapping[str, Any] | None,
                     capacity: int) -> None:
        """Hook slot banks onto the model (when ``max_loras`` > 0 or ``loras`` are given) and add ``loras``.

        Args:
            max_loras: adapters resident at once; 0 with ``loras``: one slot per given adapter.
            max_lora_rank: the slots' rank; None: the largest rank of ``loras``, at least 16.
            loras: adapters to add now, name -> folder, Hub repo or LoRA blocks.
            capacity: tokens in one step at most.

        Raises:
            ValueError: bad bounds or adapters (see ``LoRARegistry.add``).
        """
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {max_loras!r}")
        if loras is not None and not isinstance(loras, Mapping):
            raise ValueError(f"loras must map names to adapter folders or repos, got {type(loras).__name__}")
        if not max_loras and not loras:
            return
        read = {name: read_loras(self.model, source) for name, source in (loras or {}).items()}
        if max_lora_rank is None:
            ranks = [lora.r for blocks, _ in read.values() for lora in blocks.values() if isinstance(lora, LoRA)]
            max_lora_rank = max([16, *ranks])
        registry = LoRARegistry(self.model, max_loras or len(read), max_lora_rank, capacity)
        for name, (blocks, _) in read.items():
            registry.add(name, blocks)
            registry.adapters[name].source = os.fspath(loras[name]) if not isinstance(loras[name], Mapping) \
                else "<memory>"
        self.loras = registry
        self.scheduler.admit = registry.admitter(lambda: self.scheduler.running)

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("this engine serves no adapters: build it with max_loras >= 1 (zoo serve --max-loras)")
        return self.loras

    def add_lora(self, name: str, source: Any, **options: Any) -> list[str]:
        """Load an adapter as ``name``; requests may name it at once, running ones are not disturbed.

        Args:
            name: what requests will call it.
            source: a ``peft`` folder or Hub repo, or LoRA blocks by layer name.
            options: ``revision``, ``model_type``, ``token``, ``endpoint`` for reading files.

        Returns:
            The adapted layers.

        Raises:
            ValueError: see ``LoRARegistry.add``; an engine built without adapter slots.
        """
        return sorted(self._registry().add(name, source, **options).layers)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` to new requests (requests using it finish with it).

        Args:
            name: the adapter's name.

        Raises:
            ValueError: no adapter of that name.
        """
        self._registry().remove(name)

    def lora_names(self) -> list[str]:
        """The adapters requests may name.

        Returns:
            Their names.
        """
        return [] if self.loras is None else self.loras.names()

    def with_adapter(self, spec: RequestSpec, adapter: Any) -> RequestSpec:
        """A request running with an adapter, its prefix cache salted.

        Args:
            spec: the checked request.
            adapter: the adapter's name (None: the base model).

        Returns:
            ``spec`` with the adapter.

        Raises:
            ValueError: an adapter that is not loaded.
        """
        if adapter is None:
            return spec
        lora = self._registry().get(adapter)
        return dataclasses.replace(spec, adapter=lora, cache_salt=lora.cache_salt)

    def route_loras(self, scheduled: Iterable[tuple[Sequence, int]]) -> None:
        """Tell the slot banks which tokens of this step belong to which adapter.

        Args:
            scheduled: ``(sequence, new tokens)`` in batch order.
        """
        if self.loras is not None:
            self.loras.route(scheduled)
