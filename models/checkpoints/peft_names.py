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
from collections import Counter
from collections.abc import Mapping

import torch
from torch import Tensor, nn

import blocks

from ..convert.export import EXPORTER_KIND, to_transformers


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
    """Zoo linear layers -> ``Placement``; ``modules`` are every module name with a weight on the other side.

    ``family`` is the ``transformers`` ``model_type`` or ``None`` when the zoo's own names are used.
    """

    placements: dict[str, Placement]
    modules: frozenset[str]
    family: str | None

    def parts(self) -> dict[str, list[tuple[str, Placement]]]:
        """``transformers`` module -> its zoo parts ``(zoo name, placement)``."""
        out: dict[str, list[tuple[str, Placement]]] = {}
        for zoo, placement in self.placements.items():
            out.setdefault(placement.module, []).append((zoo, placement))
        return out


_CACHE: dict[tuple[type, str], dict[str | None, NameMap]] = {}


def name_maps(model: nn.Module) -> dict[str | None, NameMap]:
    """Where the model's linear layers are in each ``transformers`` family that represents the model, in the
    order ``to_transformers`` tries them (a BERT-shaped encoder is also a RoBERTa); ``{None: zoo names}`` when
    none does. Cached per class and config.
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
    with torch.device("meta"):
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
    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    placements = {
        name: Placement(name, False, torch.arange(m.out_features), torch.arange(m.in_features), m.out_features,
                        m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and owners[id(m.weight)] == 1
    }
    return NameMap(placements, frozenset(placements), None)
