"""LoRA adapters as ``peft`` files: the zoo <-> ``transformers`` module names, fused modules, folders and the Hub.

``peft`` saves a LoRA as ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules`` …) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``lora_B.weight``
``(out, r)`` for each adapted module of the ``transformers`` model; the module's output changes by
``lora_alpha / r · B A x``.

Where each zoo linear layer lives in the ``transformers`` model is not written down per family: it is read off
the family's exporter (``models.convert.to_transformers``). A copy of the model is built on the meta device, every
linear weight is filled with distinct integers (float64 holds them exactly), and the exported state dict is
searched for them: the tensor a weight lands in names the module, and where each integer lands gives the rows and
columns it occupies — also when the exporter transposes it (GPT-2's ``Conv1D``), slices it into a fused tensor
(``c_attn = [q; k; v]``) or permutes its rows. A new family with an exporter therefore needs no code here. A model
no family represents keeps its zoo module names (``peft`` can also wrap the zoo model itself).

A LoRA on a fused module is, exactly, LoRAs on its parts with one shared ``A`` and the parts' rows of ``B``.
Going back, the parts' LoRAs are stacked: ``A = [A_1; A_2 …]`` (columns placed where the part reads its input)
and ``B`` block-diagonal (rows placed where the part writes), of rank ``r_1 + r_2 …`` (``rank_pattern``), unless
the parts share one ``A``, which is then written once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCardData
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import save_file
from torch import Tensor, nn

import blocks
from blocks.adapters import LoRA

from ..convert.export import EXPORTER_KIND, to_transformers
from . import files as io

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# peft's task types for the zoo architectures that have one (peft picks its model wrapper by it).
TASK_TYPES = {"DecoderLM": "CAUSAL_LM", "Seq2SeqTransformer": "SEQ_2_SEQ_LM"}
# adapter_config.json settings whose effect the zoo does not implement: key -> the values it accepts.
UNSUPPORTED = {
    "use_dora": (None, False), "bias": (None, "none"), "lora_bias": (None, False), "modules_to_save": (None, []),
    "target_parameters": (None, []), "trainable_token_indices": (None, {}, []), "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []),
}


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


# ---------------------------------------------------------------------------------------------- zoo -> peft
def peft_files(
    model: nn.Module, name: str, base_model: str | None = None, model_type: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The ``adapter_config.json`` dict and the tensors of adapter ``name`` in the ``peft`` layout.

    Raises:
        ValueError: adapters that are not LoRA, adapted layers without a ``transformers`` module, or parts of one
            fused module with different dropouts (``peft`` has one per module).
    """
    lora: dict[str, LoRA] = {}
    for module_name, layer in model._adapted_layers():
        if name in layer.adapters:
            adapter = layer.adapters[name]
            if not isinstance(adapter, LoRA):
                raise ValueError(
                    f"adapter {name!r} on {module_name!r} is a {type(adapter).__name__}; only LoRA adapters have a "
                    "peft file layout"
                )
            lora[module_name] = adapter
    names = name_map(model, model_type)
    unmapped = sorted(set(lora) - set(names.placements))
    if unmapped:
        raise ValueError(
            f"adapter {name!r} adapts {unmapped}, which the transformers {names.family!r} model has no module for "
            "(the exporter writes them computed, repeated or not at all); adapt other layers"
        )
    groups: dict[str, list[tuple[LoRA, Placement]]] = {}
    for zoo, adapter in lora.items():
        placement = names.placements[zoo]
        groups.setdefault(placement.module, []).append((adapter, placement))

    tensors: dict[str, Tensor] = {}
    ranks: dict[str, tuple[int, float]] = {}
    dropouts = set()
    for module, parts in groups.items():
        a, b, scaling = _fuse(parts)
        dropout = {adapter.dropout_p for adapter, _ in parts}
        if len(dropout) > 1:
            raise ValueError(f"the LoRAs that make up {module!r} have different dropouts {sorted(dropout)}")
        dropouts |= dropout
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
        ranks[module] = (a.shape[0], _number(scaling * a.shape[0]))
    if len(dropouts) > 1:
        raise ValueError(f"adapter {name!r} has layers with different dropouts {sorted(dropouts)}; peft has one")

    (r, alpha), _ = Counter(ranks.values()).most_common(1)[0]
    adapted = set(groups)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapted})
    # Short names ("c_attn") when they select exactly the adapted modules, full names otherwise.
    by_leaf = {m for m in names.modules if any(m == leaf or m.endswith("." + leaf) for leaf in leaves)}
    transposed = {p.transposed for parts in groups.values() for _, p in parts}
    config = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES.get(type(model).__name__) if names.family is not None else None,
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop() if dropouts else 0.0,
        "target_modules": leaves if by_leaf == adapted else sorted(adapted),
        "rank_pattern": {re.escape(m): rm for m, (rm, _) in sorted(ranks.items()) if rm != r},
        "alpha_pattern": {re.escape(m): am for m, (_, am) in sorted(ranks.items()) if am != alpha},
        "fan_in_fan_out": transposed == {True},
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
        "revision": None,
    }
    return config, tensors


def _fuse(parts: list[tuple[LoRA, Placement]]) -> tuple[Tensor, Tensor, float]:
    """One LoRA ``(A, B, scaling)`` on a module from LoRAs on its parts (see the module docstring)."""
    first = parts[0][1]
    scaling = parts[0][0].scaling
    groups_: list[tuple[Tensor, list[tuple[LoRA, Placement]]]] = []
    for adapter, placement in parts:
        for shared, members in groups_:
            # Parts that share one A Parameter (a fused LoRA that was loaded) keep sharing it.
            if adapter.lora_A is shared and torch.equal(placement.cols, members[0][1].cols) and math.isclose(
                adapter.scaling, members[0][0].scaling
            ):
                members.append((adapter, placement))
                break
        else:
            groups_.append((adapter.lora_A, [(adapter, placement)]))
    a_blocks, b_blocks = [], []
    for shared, members in groups_:
        rank, dtype = shared.shape[0], shared.dtype
        a = torch.zeros(rank, first.in_features, dtype=dtype)
        a[:, members[0][1].cols] = shared.detach().cpu()
        b = torch.zeros(first.out_features, rank, dtype=dtype)
        for adapter, placement in members:
            # A part scaled differently from the module has its ratio folded into its rows of B.
            b[placement.rows] = adapter.lora_B.detach().cpu() * (adapter.scaling / scaling)
        a_blocks.append(a)
        b_blocks.append(b)
    return torch.cat(a_blocks), torch.cat(b_blocks, dim=1), scaling


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# ---------------------------------------------------------------------------------------------- peft -> zoo
def zoo_adapters(
    model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Tensor], source: str,
    model_type: str | None = None,
) -> dict[str, LoRA]:
    """The zoo LoRA blocks (zoo module name -> ``LoRA``, on the layers' device and dtype) of a ``peft`` adapter.

    The module names are read as those of ``model_type``, or by default of the first family that represents the
    model and has every module the adapter names (an encoder may be a BERT or a RoBERTa).

    Raises:
        ValueError: see ``AdapterMixin.load_adapter``.
    """
    loras, dropout = _read_peft(config, tensors, source)
    candidates = [name_map(model, model_type)] if model_type is not None else list(name_maps(model).values())
    errors: list[ValueError] = []
    for names in candidates:
        family = f"the transformers {names.family!r} model" if names.family else "its zoo module names"
        parts_of = names.parts()
        try:
            targets = {m: _resolve(m, parts_of, source, type(model).__name__, family) for m in loras}
        except ValueError as e:
            errors.append(e)
            continue
        return _zoo_loras(model, loras, targets, parts_of, dropout, source)
    raise errors[0]


def _zoo_loras(
    model: nn.Module, loras: Mapping[str, tuple[Tensor, Tensor, float]], targets: Mapping[str, str],
    parts_of: Mapping[str, list[tuple[str, Placement]]], dropout: float, source: str,
) -> dict[str, LoRA]:
    linears = dict(model.named_modules())
    out: dict[str, LoRA] = {}
    for module, (a, b, scaling) in loras.items():
        target = targets[module]
        parts = parts_of[target]
        out_f, in_f = parts[0][1].out_features, parts[0][1].in_features
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise ValueError(
                f"{source}: the LoRA of {module!r} is for a ({b.shape[0]}, {a.shape[1]}) weight, but this "
                f"{type(model).__name__}'s {target!r} is ({out_f}, {in_f}): an adapter for a model of other shapes"
            )
        covered = torch.zeros(out_f, dtype=torch.bool)
        for _, p in parts:
            covered[p.rows] = True
            if p.cols.numel() != in_f and bool(a[:, _complement(p.cols, in_f)].any()):
                raise ValueError(f"{source}: the LoRA of {module!r} reads inputs that the zoo layer does not")
        if bool(b[~covered].any()):
            raise ValueError(f"{source}: the LoRA of {module!r} changes outputs that no zoo layer computes")
        supports = [(b[p.rows] != 0).any(0) for _, p in parts]
        split = len(parts) > 1 and bool(b.any()) and bool((torch.stack(supports).sum(0) <= 1).all())
        shared: list[tuple[Tensor, nn.Parameter]] = []
        for (zoo, p), support in zip(parts, supports, strict=True):
            keep = support if split else torch.ones(a.shape[0], dtype=torch.bool)
            rank = int(keep.sum())
            if rank == 0:
                continue  # a block of B that is all zero: this part is not adapted
            weight = linears[zoo].weight
            lora = blocks.build(
                "adapter", "lora", in_features=p.cols.numel(), out_features=p.rows.numel(), r=rank,
                alpha=scaling * rank, dropout=dropout,
            ).to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                lora.lora_A.copy_(a[keep][:, p.cols])
                lora.lora_B.copy_(b[p.rows][:, keep])
            if not split:
                # One A for every part, as in the fused module: tie it so that training keeps it one.
                for cols, param in shared:
                    if torch.equal(cols, p.cols):
                        lora.lora_A = param
                        break
                else:
                    shared.append((p.cols, lora.lora_A))
            out[zoo] = lora
    return out


def _read_peft(
    config: Mapping[str, Any], tensors: Mapping[str, Tensor], source: str
) -> tuple[dict[str, tuple[Tensor, Tensor, float]], float]:
    """Check a ``peft`` LoRA config and its tensors; ``{module: (A, B, scaling)}`` and the dropout."""
    if not isinstance(config, Mapping) or config.get("peft_type") != "LORA":
        got = config.get("peft_type") if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(f"{source}: {ADAPTER_CONFIG_NAME} has peft_type={got!r}; only 'LORA' adapters load")
    for key, accepted in UNSUPPORTED.items():
        if config.get(key) not in accepted:
            raise ValueError(
                f"{source}: {ADAPTER_CONFIG_NAME} sets {key}={config[key]!r}, which transformer-zoo does not implement "
                f"(it accepts {[v for v in accepted if v is not None]})"
            )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{source}: {ADAPTER_CONFIG_NAME} has r={r!r}; expected a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{source}: {ADAPTER_CONFIG_NAME} has lora_alpha={alpha!r}; expected a number")
    dropout = config.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{source}: {ADAPTER_CONFIG_NAME} has lora_dropout={dropout!r}; expected a value in [0, 1)")
    rank_pattern = dict(config.get("rank_pattern") or {})
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    rslora = bool(config.get("use_rslora", False))

    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight", key)
        if match is None:
            raise ValueError(
                f"{source}: tensor {key!r} is not a LoRA weight '<module>.lora_A.weight' / '.lora_B.weight' "
                "(embedding LoRA, DoRA magnitudes and saved modules are not supported)"
            )
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:
        raise ValueError(f"{source}: the adapter holds no LoRA weights")
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{source}: {module!r} has {sorted(pair)} but a LoRA needs lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or not a.is_floating_point():
            raise ValueError(
                f"{source}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; expected (r, in) "
                "and (out, r) floating tensors"
            )
        rank = rank_pattern.get(_pattern_key(rank_pattern, module), r)
        if a.shape[0] != rank:
            raise ValueError(f"{source}: {module!r} has rank {a.shape[0]} but the config says r={rank}")
        module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        out[module] = (a.float(), b.float(), scaling)
    return out, float(dropout)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first key of ``rank_pattern``/``alpha_pattern`` that ``peft`` would apply to ``module``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _resolve(module: str, parts_of: Mapping[str, Any], source: str, model_name: str, family: str) -> str:
    """The module of the name map that the adapter's ``module`` is: the same name, or one a prefix apart (an
    adapter saved on ``BertModel`` names ``encoder.layer.0…`` where ``BertForMaskedLM`` has ``bert.encoder…``)."""
    if module in parts_of:
        return module
    near = [m for m in parts_of if m.endswith("." + module) or module.endswith("." + m)]
    if len(near) == 1:
        return near[0]
    examples = sorted(parts_of)[:4]
    reason = f"several modules fit ({near})" if near else f"its adaptable modules are named like {examples}"
    raise ValueError(
        f"{source}: the adapter targets {module!r}, which this {model_name} (as {family}) does not have: "
        f"{reason}; was the adapter saved for another architecture?"
    )


def _complement(cols: Tensor, size: int) -> Tensor:
    keep = torch.ones(size, dtype=torch.bool)
    keep[cols] = False
    return keep


# ---------------------------------------------------------------------------------------------- folders, the Hub
def save_adapter(
    model: nn.Module, save_directory: str | os.PathLike[str], name: str, *, base_model: str | None = None,
    model_type: str | None = None,
) -> Path:
    """Write adapter ``name`` of ``model`` to ``save_directory`` atomically (see ``AdapterMixin.save_adapter``)."""
    if not isinstance(save_directory, (str, os.PathLike)):
        raise TypeError(f"save_directory must be a folder path, got {type(save_directory).__name__}")
    config, tensors = peft_files(model, name, base_model, model_type)
    target = Path(save_directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save an adapter to {target}: it exists and is not a folder")
    with io.staging_folder(target) as staging:
        _write(staging, config, tensors, model, reference=str(save_directory))
        io.publish(staging, target)
    return target


def push_adapter(
    model: nn.Module,
    repo_id: str,
    name: str,
    *,
    private: bool = False,
    commit_message: str | None = None,
    revision: str | None = None,
    base_model: str | None = None,
    model_type: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CommitInfo:
    """Upload adapter ``name`` to a Hub repo in one commit (see ``AdapterMixin.push_adapter_to_hub``)."""
    validate_repo_id(repo_id)
    if not isinstance(private, bool):
        raise TypeError(f"private must be a bool, got {private!r}")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision must be a non-empty branch name, got {revision!r}")
    config, tensors = peft_files(model, name, base_model, model_type)  # every check before the first request
    api = HfApi(endpoint=endpoint, token=token, library_name=io.LIBRARY_NAME, library_version=io.library_version())
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision not in (None, "main"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="transformer-zoo-adapter-") as tmp:
        folder = Path(tmp)
        _write(folder, config, tensors, model, reference=repo_id)
        operations = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in sorted(folder.iterdir())]
        message = commit_message or "Upload LoRA adapter with transformer-zoo"
        return api.create_commit(repo_id, operations, commit_message=message, revision=revision)


def load_adapter(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    model_type: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> dict[str, LoRA]:
    """Read a ``peft`` LoRA from a folder or a Hub repo as zoo LoRA blocks (see ``AdapterMixin.load_adapter``)."""
    if model_type is not None:
        name_map(model, model_type)  # a family that cannot represent the model fails before any download
    location, config_path, weights_path = _locate(path_or_repo_id, revision, token, endpoint)
    with io.reading(location):  # a local folder is held still while a save may be replacing its files
        config = io.read_json(config_path)
        if weights_path.name == ADAPTER_PICKLE_NAME:
            tensors = io._read_pickle(weights_path)
        else:
            tensors = io._read_safetensors(weights_path)
    return zoo_adapters(model, config, tensors, location.source, model_type)


def _locate(
    path_or_repo_id: str | os.PathLike[str], revision: str | None, token: str | bool | None, endpoint: str | None
) -> tuple[io.Location, Path, Path]:
    """The adapter's location, ``adapter_config.json`` and weights: in a local folder, or downloaded from one Hub
    commit."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(f"path_or_repo_id must be a folder path or a Hub repo id, got {type(path_or_repo_id).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit string, got {type(revision).__name__}")
    path = Path(path_or_repo_id).expanduser()
    text = os.fspath(path_or_repo_id)
    path_like = isinstance(path_or_repo_id, os.PathLike) or text.startswith((".", "~", "/")) or text.count("/") > 1
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} only applies to Hub repos, but {path} is a local folder")
        if not path.is_dir():
            raise ValueError(f"{path} is a file; expected an adapter folder with {ADAPTER_CONFIG_NAME}")
        io.recover(path)  # finish or discard what an interrupted save_adapter left
        present = sorted(p.name for p in path.iterdir())
        if not (path / ADAPTER_CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG_NAME}; it holds {present}")
        location = io.Location(source=str(path), config=path / ADAPTER_CONFIG_NAME, folder=path)
        for weights in (ADAPTER_WEIGHTS_NAME, ADAPTER_PICKLE_NAME):
            if (path / weights).is_file():
                return location, location.config, path / weights
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS_NAME} or {ADAPTER_PICKLE_NAME}; it holds {present}")
    if path_like:
        raise FileNotFoundError(f"no adapter folder at {text}")
    wanted = revision or "main"
    hub = io.Location(source=f"{text}@{wanted}", config=Path(), repo_id=text, revision=wanted, commit=wanted,
                      token=token, endpoint=endpoint)
    with io._hub_context(hub):
        config = hub.fetch(ADAPTER_CONFIG_NAME)
        # The weights come from the very commit the config came from (the cache names its folder by the sha).
        if io._is_commit_sha(config.parent.name):
            hub = dataclasses.replace(hub, config=config, commit=config.parent.name)
        weights = hub.fetch_optional(ADAPTER_WEIGHTS_NAME) or hub.fetch(ADAPTER_PICKLE_NAME)
    return hub, config, weights


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module, reference: str) -> None:
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    io.write_json(config, folder / ADAPTER_CONFIG_NAME)
    (folder / io.CARD_NAME).write_text(_card(config, tensors, model, reference), encoding="utf-8")


def _card(config: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module, reference: str) -> str:
    """A short ``README.md``: peft metadata, what the adapter adapts, and how to load it with either library."""
    base = config["base_model_name_or_path"]
    data = ModelCardData(library_name="peft", base_model=base, tags=[io.LIBRARY_NAME, "lora", "peft"])
    n_params = sum(t.numel() for t in tensors.values())
    return f"""---
{data.to_yaml()}
---

# LoRA adapter

A LoRA adapter (rank {config["r"]}, alpha {config["lora_alpha"]}) for a `{type(model).__name__}`, saved with
transformer-zoo in the `peft` layout; {n_params:,} parameters on the modules `{config["target_modules"]}`.

```python
model.load_adapter({json.dumps(reference)})                     # a transformer-zoo model
peft.PeftModel.from_pretrained(transformers_model, {json.dumps(reference)})  # or peft on transformers
```
"""


class AdapterFilesMixin:
    """``save_adapter``, ``load_adapter`` and ``push_adapter_to_hub``, mixed into every model class beside
    ``ZooModel`` (whose ``models.core.adapters.AdapterMixin`` adds, switches and merges adapters)."""

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
        return save_adapter(
            self, save_directory, self.adapter_to_save(name), base_model=base_model, model_type=model_type
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
        self.check_new_adapter_name(name)
        adapters = load_adapter(
            self, path_or_repo_id, revision=revision, model_type=model_type, token=token, endpoint=endpoint
        )
        self.install_adapter(name, adapters)
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
        return push_adapter(
            self, repo_id, self.adapter_to_save(name), private=private, commit_message=commit_message,
            revision=revision, base_model=base_model, model_type=model_type, token=token, endpoint=endpoint,
        )
