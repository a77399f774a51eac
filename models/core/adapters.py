"""Adapters (LoRA) on zoo models: ``add_adapter``, ``set_adapter``, ``merge_adapter``, ``merge_and_unload`` …

``model.add_adapter(kind="lora", r=8, alpha=16, target_modules=["q_proj", "v_proj"])`` freezes the model and puts
a registered ``adapter`` block (``blocks.adapters``) beside every targeted linear layer, which becomes a
``blocks.adapters.AdaptedLinear`` keeping its ``weight`` and ``bias`` (names, Parameter objects and ties
unchanged). A quantized layer (``model.quantize(...)``, a GGUF file) becomes a
``blocks.adapters.AdaptedQuantizedLinear`` instead: its packed weights stay packed and frozen, the adapter trains in
float32 beside it (QLoRA), and merging into it is refused. Several named adapters may sit on a model; one runs at a
time (``set_adapter``) and exactly that one trains. Files use the ``peft`` layout under the module names of the
``transformers`` model the zoo model exports to (``save_adapter`` / ``load_adapter`` / ``push_adapter_to_hub`` live
in ``models.checkpoints.adapter_files``), so ``peft`` reads what the zoo writes and the other way round. This
module is module surgery only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torch import nn

import blocks
from blocks.adapters import ADAPTED_LAYERS, AdaptedQuantizedLinear, adapted, adapter_placement
from blocks.quantized import QuantizedEmbedding, QuantizedLinear

# The LoRA paper's choice (Hu et al. 2021, §7.1): adapt the query and value projections.
DEFAULT_TARGETS = ("q_proj", "v_proj")
# Output layers "all-linear" leaves alone, as peft does: they map to the vocabulary or the labels.
OUTPUT_LAYERS = ("lm_head", "mlm_head.decoder", "classifier")


class AdapterMixin:
    """Adapter methods mixed into every zoo model (see ``ZooModel``)."""

    # ------------------------------------------------------------------ adding, switching, removing
    def add_adapter(
        self,
        kind: str = "lora",
        *,
        target_modules: str | Sequence[str] = DEFAULT_TARGETS,
        name: str = "default",
        **options: Any,
    ) -> list[str]:
        """Freeze the model and add a trainable adapter beside every targeted linear layer; make it the active one.

        Args:
            kind: a registered ``adapter`` name (``blocks.names("adapter")``), e.g. ``"lora"``.
            target_modules: module names or name suffixes (``["q_proj", "v_proj"]``, ``["layers.0.ffn.up_proj"]``),
                each of which must match at least one linear layer (float or quantized: a quantized layer keeps its
                packed weights, frozen, and its adapter is float32); or one string: ``"all-linear"`` (every linear
                layer except the output layers ``lm_head``, ``mlm_head.decoder``, ``classifier``) or a regular
                expression matched against whole module names.
            name: the adapter's name (letters, digits, ``_`` and ``-``; unique on the model).
            options: the adapter block's own options; for ``"lora"``: ``r`` (rank, default 8), ``alpha``
                (default 16; the update is scaled by ``alpha / r``) and ``dropout`` (default 0).

        Returns:
            The names of the adapted linear layers.

        Raises:
            ValueError: an unknown kind or option, a bad option value (e.g. ``r <= 0``), a used or invalid name,
                a target that matches no linear layer, or a target whose weight is tied to another module (merging
                into it would change that module too). Nothing is changed then.
        """
        self.check_new_adapter_name(name)
        cls = blocks.get("adapter", kind)
        blocks.check_kwargs(cls, {"in_features": 1, "out_features": 1, **options}, what=f"adapter {kind!r}")
        targets = self._match_targets(target_modules)
        linears = dict(self.named_modules(remove_duplicate=False))
        adapters = {
            t: blocks.build("adapter", kind, in_features=linears[t].in_features, out_features=linears[t].out_features,
                            **options)
            for t in targets
        }
        self.install_adapter(name, adapters)
        return targets

    def set_adapter(self, name: str | None) -> None:
        """Run (and train) the adapter ``name``; ``None`` runs the base model alone. A merged adapter is unmerged
        first. Exactly the active adapter's weights have ``requires_grad``; the base model stays frozen.

        Args:
            name: an adapter's name, or None.

        Raises:
            ValueError: no adapter of that name (the names are listed).
        """
        if name is not None and name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r}; this model has {self.adapter_names}")
        for _, layer in self._adapted_layers():
            if layer.merged is not None and layer.merged != name:
                layer.unmerge()
            layer.active = name if name in layer.adapters else None
            for adapter_name, adapter in layer.adapters.items():
                adapter.requires_grad_(adapter_name == name)

    def delete_adapter(self, name: str) -> None:
        """Remove the adapter ``name`` (unmerging it first); layers left without adapters become plain ``nn.Linear``.

        Args:
            name: the adapter's name.

        Raises:
            ValueError: no adapter of that name.
        """
        if name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r}; this model has {self.adapter_names}")
        for module_name, layer in self._adapted_layers():
            if name not in layer.adapters:
                continue
            if layer.merged == name:
                layer.unmerge()
            if layer.active == name:
                layer.active = None
            del layer.adapters[name]
            if not layer.adapters:
                self._replace(module_name, layer.plain())

    @property
    def adapter_names(self) -> list[str]:
        """The names of the adapters on this model, sorted."""
        return sorted({n for _, layer in self._adapted_layers() for n in layer.adapters})

    @property
    def active_adapter(self) -> str | None:
        """The adapter that runs, or ``None``."""
        active = {layer.active for _, layer in self._adapted_layers()} - {None}
        return next(iter(active)) if active else None

    # ------------------------------------------------------------------ merging
    def merge_adapter(self) -> None:
        """Fold the active adapter into the weights of the layers it adapts: the model then computes the same
        logits (within floating-point rounding) at the cost of the base model alone. ``unmerge_adapter`` undoes it;
        switching adapters unmerges first. Train only unmerged: a merged adapter does not run, so gets no gradient.

        Raises:
            ValueError: no active adapter, or it adapts quantized layers (their packed weights cannot hold the
                update: keep it unmerged, or ``dequantize()`` the model first); nothing is changed then.
        """
        active = self.active_adapter
        if active is None:
            raise ValueError(f"no active adapter to merge; the adapters are {self.adapter_names} (see set_adapter)")
        packed = [name for name, layer in self._adapted_layers()
                  if isinstance(layer, AdaptedQuantizedLinear) and layer.packed and layer.active == active]
        if packed:
            more = f" and {len(packed) - 1} more" if len(packed) > 1 else ""
            scheme = self.get_submodule(packed[0]).base.scheme
            raise ValueError(
                f"cannot merge adapter {active!r}: it adapts {packed[0]!r}{more}, quantized as {scheme!r}, whose "
                "packed weights cannot hold W + ΔW (quantizing the sum again would change what the model computes); "
                "keep the adapter unmerged (it runs beside the packed layers), or call model.dequantize() first and "
                "merge into the float weights"
            )
        for _, layer in self._adapted_layers():
            layer.merge()

    def unmerge_adapter(self) -> None:
        """Take a merged adapter out of the weights again (exact up to floating-point rounding); a no-op if none is."""
        for _, layer in self._adapted_layers():
            layer.unmerge()

    def merge_and_unload(self) -> nn.Module:
        """Merge the active adapter (if any), drop every adapter and unfreeze the model: what remains is the plain
        model with the adapted weights, which ``save_pretrained`` writes and ``to_transformers`` exports.

        Returns:
            ``self``.

        Raises:
            ValueError: the active adapter adapts quantized layers (see ``merge_adapter``; ``set_adapter(None)``
                first drops the adapters unmerged).
        """
        if self.active_adapter is not None:
            self.merge_adapter()
        for module_name, layer in self._adapted_layers():
            self._replace(module_name, layer.plain())
        self.requires_grad_(True)
        return self

    # ------------------------------------------------------------------ helpers (the public three serve
    # ``models.checkpoints.adapter_files``, which reads and writes adapters)
    def _adapted_layers(self) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, ADAPTED_LAYERS)]

    def adapter_to_save(self, name: str | None) -> str:
        """The adapter ``save_adapter``/``push_adapter_to_hub`` write: ``name``, or the active one when ``None``.

        Args:
            name: an adapter's name, or None.

        Returns:
            The adapter's name.

        Raises:
            ValueError: no adapter of that name, or None with no active adapter.
        """
        if name is None:
            name = self.active_adapter
            if name is None:
                raise ValueError(f"no active adapter to save; name one of {self.adapter_names}")
        elif name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r}; this model has {self.adapter_names}")
        return name

    def check_new_adapter_name(self, name: str) -> None:
        """Check that ``name`` is a valid adapter name this model does not use yet.

        Args:
            name: the new adapter's name.

        Raises:
            ValueError: a name that is not a non-empty string of letters, digits, '_' and '-', or one in use.
        """
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise ValueError(f"adapter name must be a non-empty string of letters, digits, '_' and '-', got {name!r}")
        if name in self.adapter_names:
            raise ValueError(f"this model already has an adapter named {name!r}; delete_adapter it or pick a new name")

    def _match_targets(self, target_modules: str | Sequence[str]) -> list[str]:
        """The names of the linear layers ``target_modules`` selects (see ``add_adapter``), in model order."""
        linears, owners = self._linear_layers()
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
        if isinstance(target_modules, str):
            if target_modules == "all-linear":
                chosen = [n for n in linears if n not in OUTPUT_LAYERS]
            else:
                try:
                    pattern = re.compile(target_modules)
                except re.error as e:
                    raise ValueError(f"target_modules={target_modules!r} is not a valid regular expression: {e}") from e
                chosen = [n for n in linears if pattern.fullmatch(n)]
            if not chosen:
                raise ValueError(
                    f"target_modules={target_modules!r} matches no linear layer of this {type(self).__name__} "
                    f"(a regular expression must match whole names such as {linears[:1]}); layer names end in {leaves}"
                )
        elif (
            isinstance(target_modules, Sequence) and target_modules
            and all(isinstance(t, str) and t for t in target_modules)
        ):
            for target in target_modules:
                if not any(n == target or n.endswith("." + target) for n in linears):
                    raise ValueError(
                        f"target module {target!r} matches no linear layer of this {type(self).__name__}; "
                        f"layer names end in {leaves}"
                    )
            chosen = [n for n in linears if any(n == t or n.endswith("." + t) for t in target_modules)]
        else:
            raise ValueError(
                f"target_modules must be a non-empty list of module names, 'all-linear' or a regular expression, "
                f"got {target_modules!r}"
            )
        for target in chosen:
            sharing = [o for o in owners[target] if o != target]
            if sharing:
                raise ValueError(
                    f"cannot adapt {target!r}: its weight is tied to {sharing}, so merging an adapter into it would "
                    "change those modules too; leave it out of target_modules"
                )
        return chosen

    def _linear_layers(self) -> tuple[list[str], dict[str, list[str]]]:
        """The linear layers adapters may target, in model order — float (``nn.Linear``) and quantized, adapted or
        not, but not a quantized embedding's packed ``table`` nor the ``base`` inside an adapted quantized layer —
        and for each, the layer names holding its weight (itself, and any it is tied to)."""
        modules = list(self.named_modules(remove_duplicate=False))
        by_name = dict(modules)

        def layer_name(name: str) -> str:  # an embedding's table and an adapted layer's base go by their holder
            parent, _, leaf = name.rpartition(".")
            holder = by_name.get(parent)
            inner = ((leaf == "table" and isinstance(holder, QuantizedEmbedding))
                     or (leaf == "base" and isinstance(holder, AdaptedQuantizedLinear)))
            return parent if inner else name

        holders: dict[int, list[str]] = {}  # id of a weight (a Parameter, or a packed layer) -> layer names
        for module_name, module in modules:
            keys = [id(p) for p in module.parameters(recurse=False)]
            if isinstance(module, QuantizedLinear):
                keys.append(id(module))
            for key in keys:
                holders.setdefault(key, [])
                if layer_name(module_name) not in holders[key]:
                    holders[key].append(layer_name(module_name))
        linears, seen, owners = [], set(), {}
        for module_name, module in modules:
            if layer_name(module_name) != module_name or id(module) in seen:
                continue
            if isinstance(module, (nn.Linear, QuantizedLinear, AdaptedQuantizedLinear)):
                seen.add(id(module))
                linears.append(module_name)
                weight = module.base if isinstance(module, AdaptedQuantizedLinear) else module
                owners[module_name] = holders[id(weight) if isinstance(weight, QuantizedLinear) else id(weight.weight)]
        return linears, owners

    def install_adapter(self, name: str, adapters: dict[str, nn.Module]) -> None:
        """Freeze the model, put ``adapters`` (module name -> adapter block) beside their layers, activate ``name``.
        A quantized layer's adapter is float32 (``blocks.adapters.adapter_placement``).

        Args:
            name: the adapter's name.
            adapters: module name -> adapter block (e.g. ``blocks.adapters.LoRA``).
        """
        self.requires_grad_(False)
        modules = dict(self.named_modules(remove_duplicate=False))
        for module_name, adapter in adapters.items():
            layer = adapted(modules[module_name])
            if layer is not modules[module_name]:
                self._replace(module_name, layer)
            device, dtype = adapter_placement(layer)
            adapter.to(device=device, dtype=dtype)
            layer.adapters[name] = adapter
        self.set_adapter(name)

    def _replace(self, module_name: str, module: nn.Module) -> None:
        parent_name, _, leaf = module_name.rpartition(".")
        setattr(self.get_submodule(parent_name), leaf, module)
