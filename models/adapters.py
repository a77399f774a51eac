"""Adapters (LoRA) on zoo models: ``add_adapter``, ``set_adapter``, ``merge_adapter``, ``save_adapter`` …

``model.add_adapter(kind="lora", r=8, alpha=16, target_modules=["q_proj", "v_proj"])`` freezes the model and puts
a registered ``adapter`` block (``blocks.adapters``) beside every targeted linear layer, which becomes a
``blocks.adapters.AdaptedLinear`` keeping its ``weight`` and ``bias`` (names, Parameter objects and ties
unchanged). Several named adapters may sit on a model; one runs at a time (``set_adapter``) and exactly that one
trains. Files use the ``peft`` layout under the module names of the ``transformers`` model the zoo model exports
to (see ``models.adapter_io``), so ``peft`` reads what the zoo writes and the other way round.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

import blocks
from blocks.adapters import AdaptedLinear

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

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
                each of which must match at least one linear layer; or one string: ``"all-linear"`` (every linear
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
        self._check_new_name(name)
        cls = blocks.get("adapter", kind)
        blocks.check_kwargs(cls, {"in_features": 1, "out_features": 1, **options}, what=f"adapter {kind!r}")
        targets = self._match_targets(target_modules)
        linears = dict(self.named_modules())
        adapters = {
            t: blocks.build("adapter", kind, in_features=linears[t].in_features, out_features=linears[t].out_features,
                            **options)
            for t in targets
        }
        self._install_adapter(name, adapters)
        return targets

    def set_adapter(self, name: str | None) -> None:
        """Run (and train) the adapter ``name``; ``None`` runs the base model alone. A merged adapter is unmerged
        first. Exactly the active adapter's weights have ``requires_grad``; the base model stays frozen.

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
            ValueError: no active adapter.
        """
        if self.active_adapter is None:
            raise ValueError(f"no active adapter to merge; the adapters are {self.adapter_names} (see set_adapter)")
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
        """
        if self.active_adapter is not None:
            self.merge_adapter()
        for module_name, layer in self._adapted_layers():
            self._replace(module_name, layer.plain())
        self.requires_grad_(True)
        return self

    # ------------------------------------------------------------------ files and the Hub
    def save_adapter(
        self,
        save_directory: str | os.PathLike[str],
        name: str | None = None,
        *,
        base_model: str | None = None,
        model_type: str | None = None,
    ) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` in the ``peft`` layout, atomically.

        Module names are those of the ``transformers`` model the zoo model exports to (``models.convert``), so
        ``peft.PeftModel.from_pretrained(transformers_model, folder)`` reproduces this model's logits; a LoRA on
        layers that ``transformers`` fuses (GPT-2's ``c_attn`` holds q, k and v) is written as one LoRA on the
        fused module. A model no ``transformers`` family represents keeps its zoo module names.

        Args:
            save_directory: the folder (created if needed; other files in it are left alone).
            name: which adapter (default: the active one).
            base_model: recorded as ``base_model_name_or_path`` (e.g. the Hub repo of the base model).
            model_type: the ``transformers`` family whose module names to write (default: the first that
                represents the model, as ``models.convert.to_transformers`` picks; a BERT-shaped encoder that came
                from a RoBERTa checkpoint needs ``model_type="roberta"``).

        Returns:
            The folder's path.

        Raises:
            ValueError: no such adapter, an adapter kind without a ``peft`` layout, a ``model_type`` that cannot
                represent the model, or adapted layers that the ``transformers`` model has no module for. Nothing is
                written then.
        """
        from . import adapter_io

        return adapter_io.save_adapter(
            self, save_directory, self._adapter_to_save(name), base_model=base_model, model_type=model_type
        )

    def load_adapter(
        self,
        path_or_repo_id: str | os.PathLike[str],
        name: str = "default",
        *,
        revision: str | None = None,
        model_type: str | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
    ) -> list[str]:
        """Load a LoRA adapter that ``peft`` (or ``save_adapter``) saved, from a folder or a Hub repo, and make it
        the active one. The model is frozen as by ``add_adapter``.

        Module names are mapped from the ``transformers`` model the zoo model exports to; an adapter saved on a
        base model (``BertModel``) or a task model (``BertForMaskedLM``) both load. A LoRA on a fused
        ``transformers`` module becomes LoRAs on the zoo's layers with one shared ``A`` (tied, so training goes on
        as in ``peft``) and the matching slices of ``B``; when ``B`` is block-diagonal over the parts (as
        ``save_adapter`` writes separate LoRAs), each part gets back its own smaller LoRA.

        Args:
            path_or_repo_id: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` (or
                ``adapter_model.bin``, read with ``weights_only=True``), or a Hub repo id.
            name: the name to give the adapter on this model.
            revision: Hub branch, tag or commit (default ``"main"``); not for local folders.
            model_type: read the module names as this ``transformers`` family's (default: the first family that
                represents the model and has every module the adapter names).
            token, endpoint: passed to ``huggingface_hub``.

        Returns:
            The names of the adapted zoo layers.

        Raises:
            ValueError: a used or invalid name; a config that is not LoRA or uses what the zoo does not implement
                (DoRA, trained biases, ``modules_to_save``, embedding LoRA); modules this model does not have (an
                adapter for another architecture) or tensors of other shapes; a fused module whose LoRA cannot be
                split. Nothing is changed then.
            FileNotFoundError: a folder without the adapter files.
            huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: from the Hub.
        """
        from . import adapter_io

        self._check_new_name(name)
        adapters = adapter_io.load_adapter(
            self, path_or_repo_id, revision=revision, model_type=model_type, token=token, endpoint=endpoint
        )
        self._install_adapter(name, adapters)
        return sorted(adapters)

    def push_adapter_to_hub(
        self,
        repo_id: str,
        name: str | None = None,
        *,
        private: bool = False,
        commit_message: str | None = None,
        revision: str | None = None,
        base_model: str | None = None,
        model_type: str | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
    ) -> CommitInfo:
        """Upload the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``) to a
        Hub model repo in one commit, creating the repo and the branch if needed.

        Args:
            repo_id: ``"namespace/name"``.
            name: which adapter (default: the active one).
            private: create the repo private (ignored when it exists).
            commit_message: default ``"Upload LoRA adapter with transformer-zoo"``.
            revision: branch to commit to (default ``"main"``).
            base_model: recorded as ``base_model_name_or_path`` and in the card.
            model_type: the ``transformers`` family whose module names to write (see ``save_adapter``).
            token, endpoint: passed to ``huggingface_hub``.

        Returns:
            ``huggingface_hub.CommitInfo`` (``.oid`` is the commit sha).

        Raises:
            ValueError: as ``save_adapter`` (before any request), or an invalid ``repo_id``/``revision``.
            huggingface_hub.errors.HfHubHTTPError: the Hub refused.
        """
        from . import adapter_io

        return adapter_io.push_adapter(
            self, repo_id, self._adapter_to_save(name), private=private, commit_message=commit_message,
            revision=revision, base_model=base_model, model_type=model_type, token=token, endpoint=endpoint,
        )

    # ------------------------------------------------------------------ helpers
    def _adapted_layers(self) -> list[tuple[str, AdaptedLinear]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, AdaptedLinear)]

    def _adapter_to_save(self, name: str | None) -> str:
        if name is None:
            name = self.active_adapter
            if name is None:
                raise ValueError(f"no active adapter to save; name one of {self.adapter_names}")
        elif name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r}; this model has {self.adapter_names}")
        return name

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise ValueError(f"adapter name must be a non-empty string of letters, digits, '_' and '-', got {name!r}")
        if name in self.adapter_names:
            raise ValueError(f"this model already has an adapter named {name!r}; delete_adapter it or pick a new name")

    def _match_targets(self, target_modules: str | Sequence[str]) -> list[str]:
        """The names of the linear layers ``target_modules`` selects (see ``add_adapter``), in model order."""
        linears = [n for n, m in self.named_modules() if isinstance(m, nn.Linear)]
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
        owners: dict[int, list[str]] = {}
        for module_name, module in self.named_modules(remove_duplicate=False):
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), []).append(module_name)
        modules = dict(self.named_modules())
        for target in chosen:
            sharing = [o for o in owners[id(modules[target].weight)] if o != target]
            if sharing:
                raise ValueError(
                    f"cannot adapt {target!r}: its weight is tied to {sharing}, so merging an adapter into it would "
                    "change those modules too; leave it out of target_modules"
                )
        return chosen

    def _install_adapter(self, name: str, adapters: dict[str, nn.Module]) -> None:
        """Freeze the model, put ``adapters`` (module name -> adapter block) beside their layers, activate ``name``."""
        self.requires_grad_(False)
        modules = dict(self.named_modules())
        for module_name, adapter in adapters.items():
            layer = modules[module_name]
            if not isinstance(layer, AdaptedLinear):
                layer = AdaptedLinear(layer)
                self._replace(module_name, layer)
            adapter.to(device=layer.weight.device, dtype=layer.weight.dtype)
            layer.adapters[name] = adapter
        self.set_adapter(name)

    def _replace(self, module_name: str, module: nn.Module) -> None:
        parent_name, _, leaf = module_name.rpartition(".")
        setattr(self.get_submodule(parent_name), leaf, module)


def check_exportable(model: nn.Module, action: str, *, allow_merged: bool) -> None:
    """Refuse to write a model whose adapters its weights do not hold.

    ``save_pretrained`` (``allow_merged=False``) writes only the base model's tensors, so any adapter would be lost or
    stored under names no loader reads; an export to ``transformers`` (``allow_merged=True``) computes what the model
    computes when no adapter is active or the active one is merged into the weights.

    Raises:
        ValueError: naming the adapted module and what to call instead (``merge_and_unload()`` or ``save_adapter()``).
    """
    for name, module in model.named_modules():
        if not isinstance(module, AdaptedLinear) or not len(module.adapters):
            continue
        if allow_merged and (module.active is None or module.merged is not None):
            continue
        raise ValueError(
            f"cannot {action}: module {name!r} carries adapters {list(module.adapters)} that the weights do not "
            "hold; call model.merge_and_unload() first to bake the active adapter in, or save the adapter alone "
            "with model.save_adapter(folder)"
        )
