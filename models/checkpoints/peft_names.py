"""Where each zoo linear layer lives in the ``transformers`` model of each family: the module names of ``peft`` files.

This is not written down per family: it is read off the family's exporter (``models.convert.to_transformers``). A
copy of the model is built on the meta device, every linear weight is filled with distinct integers (float64 holds
them exactly), and the exported state dict is searched for them: the tensor a weight lands in names the module, and
where each integer lands gives the rows and columns it occupies — also when the exporter transposes it (GPT-2's
``Conv1D``), slices it into a fused tensor (``c_attn = [q; k; v]``) or permutes its rows. A new family with an
exporter therefore needs no code here. A model no family represents keeps its zoo module names (``peft`` can also
wrap the zoo model itself).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Mapping

import torch
from torch import Tensor, nn

import blocks

from ..convert.export import EXPORTER_KIND, to_transformers
from ..core.meta_build import meta_build


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a zoo linear layer's weight sits in a ``transformers`` module's weight.

    Attributes:
        module: the ``transformers`` module name (``"transformer.h.0.attn.c_attn"``).
        transposed: the ``transformers`` weight is stored ``(in, out)`` (GPT-2's ``Conv1D``).
        rows: ``(out_zoo,)`` the module output each zoo output row is.
        cols: ``(in_zoo,)`` the module input each zoo input column is.
        out_features, in_features: the ``transformers`` module's output and input widths.
    """

    module: str
    transposed: bool
    rows: Tensor
    cols: Tensor
    out_features: int
    in_features: int


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Zoo linear layers -> ``Placement``, in one family's module names.

    Attributes:
        placements: zoo linear layer name -> where its weight sits.
        modules: every module name with a weight on the other side.
        family: the ``transformers`` ``model_type``, or None when the zoo's own names are used.
    """

    placements: dict[str, Placement]
    modules: frozenset[str]
    family: str | None

    def parts(self) -> dict[str, list[tuple[str, Placement]]]:
        """``transformers`` module -> its zoo parts ``(zoo name, placement)``.

        Returns:
            The placements grouped by the module they sit in (a fused module has several parts).
        """
        out: dict[str, list[tuple[str, Placement]]] = {}
        for zoo, placement in self.placements.items():
            out.setdefault(placement.module, []).append((zoo, placement))
        return out


_CACHE: dict[tuple[type, str], dict[str | None, NameMap]] = {}


def name_maps(model: nn.Module) -> dict[str | None, NameMap]:
    """Where the model's linear layers are in each ``transformers`` family that represents the model, in the
    order ``to_transformers`` tries them (a BERT-shaped encoder is also a RoBERTa); ``{None: zoo names}`` when
    none does. Cached per class and config.

    Args:
        model: the zoo model.

    Returns:
        ``model_type`` (or None) -> its ``NameMap``.
    """
    # The attention backend is a runtime choice that no exporter writes: switching it must not re-probe.
    config = {k: v for k, v in model.config.to_dict().items() if k != "attention_backend"}
    key = (type(model), json.dumps(config, sort_keys=True, default=str))
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _probe(model) or {None: _identity(model)}
    return _CACHE[key]


def name_map(model: nn.Module, model_type: str | None = None) -> NameMap:
    """The ``NameMap`` of family ``model_type`` (default: the first that represents the model, as
    ``to_transformers`` picks; the zoo's own names when none does).

    Args:
        model: the zoo model.
        model_type: the ``transformers`` family, or None for the default.

    Returns:
        The family's map.

    Raises:
        ValueError: a ``model_type`` that does not represent this model (those that do are listed).
    """
    maps = name_maps(model)
    if model_type is None:
        return next(iter(maps.values()))
    if model_type not in maps:
        raise ValueError(
            f"the transformers family {model_type!r} cannot represent this {type(model).__name__}; the families "
            f"that can are {[f for f in maps if f is not None]}"
        )
    return maps[model_type]


def _probe(model: nn.Module) -> dict[str | None, NameMap]:
    """One probe model, exported by every family (see the module docstring)."""
    with meta_build():
        probe = type(model)(model.config)
    owners: dict[int, int] = Counter(id(p) for m in probe.modules() for p in m.parameters(recurse=False))
    names, offsets, shapes, total = [], [], [], 0
    for name, module in probe.named_modules():
        if not isinstance(module, nn.Linear) or owners[id(module.weight)] > 1:
            continue  # a tied weight (lm_head = embedding) is never adapted
        out_f, in_f = module.weight.shape
        ids = torch.arange(total, total + out_f * in_f, dtype=torch.float64).view(out_f, in_f)
        module.weight = nn.Parameter(ids, requires_grad=False)
        names.append(name)
        offsets.append(total)
        shapes.append((out_f, in_f))
        total += out_f * in_f
    maps: dict[str | None, NameMap] = {}
    for family in blocks.names(EXPORTER_KIND):
        try:
            _, state = to_transformers(probe, family)
        except ValueError:  # this family cannot represent the model
            continue
        maps[family] = _decode(state, names, offsets, shapes, total, family)
    return maps


def _decode(
    state: Mapping[str, Tensor], names: list[str], offsets: list[int], shapes: list[tuple[int, int]], total: int,
    family: str,
) -> NameMap:
    """Find each probe weight in an exported state dict."""
    starts = torch.tensor(offsets, dtype=torch.long)
    found: dict[str, list[Placement]] = {}
    modules = set()
    for key, tensor in state.items():
        if not key.endswith(".weight"):
            continue
        modules.add(key.removesuffix(".weight"))
        if tensor.device.type == "meta" or tensor.dtype != torch.float64 or tensor.dim() != 2:
            continue
        flat = tensor.reshape(-1)
        if not bool((flat == flat.round()).all()) or flat.min() < 0 or flat.max() >= total:
            continue  # not probe values: the exporter computed this tensor
        flat = flat.long()
        owner = torch.searchsorted(starts, flat, right=True) - 1
        for k in torch.bincount(owner, minlength=len(offsets)).nonzero().squeeze(1).tolist():
            where = (owner == k).nonzero().squeeze(1)  # flat positions in the exported tensor
            out_f, in_f = shapes[k]
            if where.numel() != out_f * in_f:
                continue  # only part of the weight, or some of it twice: not a placement an adapter can follow
            # With as many positions as elements, a consistent row and column map (below) also proves that
            # every element appears once: two positions of one element would have the same row and column.
            local = flat[where] - offsets[k]
            i, j = local // in_f, local % in_f
            a, b = where // tensor.shape[1], where % tensor.shape[1]
            placement = _product(key, i, j, a, b, out_f, in_f, tuple(tensor.shape), transposed=False)
            if placement is None:
                placement = _product(key, i, j, b, a, out_f, in_f, tuple(tensor.shape)[::-1], transposed=True)
            if placement is not None:
                found.setdefault(names[k], []).append(placement)
    # A weight written to two tensors has no single home; such a layer cannot be mapped (and raises if adapted).
    placements = {zoo: ps[0] for zoo, ps in found.items() if len(ps) == 1}
    return NameMap(placements, frozenset(modules), family)


def _product(
    key: str, i: Tensor, j: Tensor, a: Tensor, b: Tensor, out_f: int, in_f: int, shape: tuple[int, ...],
    *, transposed: bool,
) -> Placement | None:
    """The placement if element ``(i, j)`` of the zoo weight sits at row ``a = rows[i]``, column ``b = cols[j]``."""
    rows = torch.full((out_f,), -1, dtype=torch.long).index_put_((i,), a)
    cols = torch.full((in_f,), -1, dtype=torch.long).index_put_((j,), b)
    if not (bool((rows[i] == a).all()) and bool((cols[j] == b).all())):
        return None
    return Placement(key.removesuffix(".weight"), transposed, rows, cols, shape[0], shape[1])


def _identity(model: nn.Module) -> NameMap:
    """The zoo's own names of the model's untied linear layers, read off a float copy built from its config (as
    ``_probe`` does: the layers of a quantized model are no ``nn.Linear``, and the map is cached per config)."""
    with meta_build():
        probe = type(model)(model.config)
    owners = Counter(id(p) for m in probe.modules() for p in m.parameters(recurse=False))
    placements = {
        name: Placement(name, False, torch.arange(m.out_features), torch.arange(m.in_features), m.out_features,
                        m.in_features)
        for name, m in probe.named_modules()
        if isinstance(m, nn.Linear) and owners[id(m.weight)] == 1
    }
    return NameMap(placements, frozenset(placements), None)


# ---------------------------------------------------------------------------------------------- peft's targets
@dataclasses.dataclass(frozen=True)
class PeftTargets:
    """Which modules a ``peft`` LoRA config adapts, decided as ``peft.tuners.tuners_utils.check_target_module_exists``
    decides it: ``exclude_modules`` first, then ``target_modules`` (a regular expression matched against the whole
    module name, or names matched exactly or as a ``.``-separated suffix) and, for a suffix match only, the layer
    index (the first ``<layers_pattern>.<index>.`` in the name, any ``<name>.<index>.`` without a pattern) must be
    in ``layers_to_transform``.

    Build it with ``from_config``, which checks every field's type and each pattern.

    Attributes:
        target_modules: a regular expression, or module names (exact or suffixes).
        exclude_modules: the same form, for the modules never adapted; or None.
        layers_to_transform: the layer indices adapted (suffix matches only), or None for all.
        layers_pattern: the names before the layer index (``"layers"``, ``"h"``), or empty for any.
    """

    target_modules: str | frozenset[str]
    exclude_modules: str | frozenset[str] | None = None
    layers_to_transform: frozenset[int] | None = None
    layers_pattern: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping, where: str) -> PeftTargets:
        """The targets of an ``adapter_config.json`` dict; ``where`` starts each error message (the file).

        Args:
            config: the parsed ``adapter_config.json``.
            where: starts each error message (the file).

        Returns:
            The checked targets.

        Raises:
            ValueError: naming the field: ``target_modules`` missing, empty, ``"all-linear"`` (``peft`` expands it
                against the ``transformers`` classes when it loads; a file it saved lists the names), or not a
                valid regular expression or list of names; ``exclude_modules`` likewise; ``layers_to_transform``
                not a non-negative integer or a list of them; ``layers_pattern`` not a string or list of valid
                patterns; and the combinations ``peft``'s ``LoraConfig`` refuses (layers with a regex
                ``target_modules``, ``layers_pattern`` without ``layers_to_transform``).
        """
        target = config.get("target_modules")
        if target == "all-linear":
            raise ValueError(
                f"{where} has target_modules='all-linear', which peft expands against the transformers model's layer "
                "classes when it loads; transformer-zoo does not: expected the module names (peft saves them)"
            )
        target = _names_or_regex(target, "target_modules", where, optional=False)
        exclude = _names_or_regex(config.get("exclude_modules"), "exclude_modules", where, optional=True)
        layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
        if isinstance(target, str) and (layers is not None or pattern is not None):
            field = "layers_to_transform" if layers is not None else "layers_pattern"
            raise ValueError(
                f"{where} sets {field}={(layers if layers is not None else pattern)!r} with a regular expression "
                f"target_modules={target!r}; peft refuses that combination (expected {field}=null)"
            )
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and (
            not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                    for i in layers)
        ):
            raise ValueError(
                f"{where} has layers_to_transform={layers!r}; expected null, a layer index or a list of layer indices "
                "(integers >= 0)"
            )
        patterns = [pattern] if isinstance(pattern, str) else pattern if pattern is not None else []
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"{where} has layers_pattern={pattern!r}; expected null, a string or a list of strings")
        for p in patterns:
            check_pattern(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern", p, where)
        patterns = [p for p in patterns if p]
        if patterns and layers is None:
            raise ValueError(
                f"{where} sets layers_pattern={pattern!r} without layers_to_transform; peft refuses that (expected "
                "layers_to_transform to name the layers)"
            )
        return cls(target, exclude, frozenset(layers) if layers else None, tuple(patterns))

    def selects(self, module: str) -> bool:
        """Whether ``peft`` adapts the module named ``module`` (its name in the ``transformers`` model).

        Args:
            module: the module's name in the ``transformers`` model.

        Returns:
            True when these targets select it.
        """
        if self.exclude_modules and _matches(self.exclude_modules, module):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True  # an exact name is adapted whatever its layer (peft checks the layer for suffixes only)
        if not _matches(self.target_modules, module):
            return False
        if self.layers_to_transform is None:
            return True
        match = None
        for pattern in self.layers_pattern or (None,):
            regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
            match = re.match(regex, module)
            if match is not None:
                break
        return match is not None and int(match["idx"]) in self.layers_to_transform


def _matches(names: str | frozenset[str], module: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return module in names or any(module.endswith("." + name) for name in names)


def _names_or_regex(value: object, field: str, where: str, *, optional: bool) -> str | frozenset[str] | None:
    """A checked ``target_modules``/``exclude_modules`` value: a valid regex, or a non-empty list of names."""
    if value is None and optional:
        return None
    if isinstance(value, str) and (value or optional):
        check_pattern(value, field, value, where)
        return value
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value) and (value or optional):
        return frozenset(value)
    raise ValueError(
        f"{where} has {field}={value!r}; expected {'null, ' if optional else ''}a regular expression or a non-empty "
        "list of module names"
    )


def check_pattern(regex: str, field: str, pattern: str, where: str) -> None:
    """``re.compile(regex)``, whose error (a ``ValueError``) names ``field`` and the ``pattern`` it was built from.

    Args:
        regex: the regular expression to compile.
        field: the config field it comes from.
        pattern: the field's value it was built from.
        where: starts the error message (the file).

    Raises:
        ValueError: ``regex`` does not compile.
    """
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"{where} has {field} {pattern!r}, which is not a valid regular expression: {e}") from e

