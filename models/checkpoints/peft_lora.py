"""LoRA adapters in ``peft``'s layout: zoo ``LoRA`` blocks <-> ``adapter_config.json`` and the LoRA tensors.

``peft`` saves a LoRA as ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules`` …) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``lora_B.weight``
``(out, r)`` for each adapted module of the ``transformers`` model; the module's output changes by
``lora_alpha / r · B A x``. The module names come from ``models.checkpoints.peft_names``.

A LoRA on a fused module is, exactly, LoRAs on its parts with one shared ``A`` and the parts' rows of ``B``.
Going back, the parts' LoRAs are stacked: ``A = [A_1; A_2 …]`` (columns placed where the part reads its input)
and ``B`` block-diagonal (rows placed where the part writes), of rank ``r_1 + r_2 …`` (``rank_pattern``), unless
the parts share one ``A``, which is then written once.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

import blocks
from blocks.adapters import LoRA, adapter_placement

from .peft_names import PeftTargets, Placement, check_pattern, name_map, name_maps

ADAPTER_CONFIG_NAME = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# peft's task types for the zoo architectures that have one (peft picks its model wrapper by it).
TASK_TYPES = {"DecoderLM": "CAUSAL_LM", "Seq2SeqTransformer": "SEQ_2_SEQ_LM"}
# adapter_config.json settings whose effect the zoo does not implement: key -> the values it accepts.
UNSUPPORTED = {
    "use_dora": (None, False), "bias": (None, "none"), "lora_bias": (None, False), "modules_to_save": (None, []),
    "target_parameters": (None, []), "trainable_token_indices": (None, {}, []), "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []), "use_qalora": (None, False), "use_bdlora": (None, False),
    "arrow_config": (None,), "kasa_config": (None,), "monteclora_config": (None,), "velora_config": (None,),
    "megatron_config": (None,),
}



# ---------------------------------------------------------------------------------------------- zoo -> peft
def peft_files(
    model: nn.Module, name: str, base_model: str | None = None, model_type: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The ``adapter_config.json`` dict and the tensors of adapter ``name`` in the ``peft`` layout.

    Args:
        model: the adapted model.
        name: the adapter's name.
        base_model: the base model's name or path to record in the config, or None.
        model_type: the ``transformers`` family whose module names to use (None: the first that represents the
            model).

    Returns:
        ``(config, tensors)``: the ``adapter_config.json`` dict and ``base_model.model.<module>.lora_A.weight`` /
        ``lora_B.weight`` tensors (fused modules' LoRAs fused into one).

    Raises:
        ValueError: adapters that are not LoRA, adapted layers without a ``transformers`` module, or parts of one
            fused module with different dropouts (``peft`` has one per module).

    Shapes: each module's ``lora_A`` ``(r, in_features)`` and ``lora_B`` ``(out_features, r)``.
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

    Args:
        model: the model the adapter loads into.
        config: the parsed ``adapter_config.json``.
        tensors: the adapter file's tensors.
        source: names the adapter in messages.
        model_type: the ``transformers`` family the module names are read as, or None to try each.

    Returns:
        Zoo module name -> ``LoRA`` block.

    Raises:
        ValueError: see ``AdapterFilesMixin.load_adapter`` (``models.checkpoints.adapter_files``).

    Shapes: each module's ``lora_A`` ``(r, in_features)`` and ``lora_B`` ``(out_features, r)``.
    """
    loras, dropout, selection, missing_ok = _read_peft(config, tensors, source)
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
        missing = sorted(m for m in parts_of if m not in targets.values() and selection.selects(m))
        if missing and not missing_ok:
            raise ValueError(
                f"{source}: {ADAPTER_CONFIG_NAME}'s target_modules={config.get('target_modules')!r} selects {missing}, "
                f"which the adapter holds no weights for, and init_lora_weights={config.get('init_lora_weights')!r} "
                "makes peft initialise them at random; expected weights for every targeted module"
            )
        return _zoo_loras(model, loras, targets, parts_of, dropout, source)
    raise errors[0]


def _zoo_loras(
    model: nn.Module, loras: Mapping[str, tuple[Tensor, Tensor, float]], targets: Mapping[str, str],
    parts_of: Mapping[str, list[tuple[str, Placement]]], dropout: float, source: str,
) -> dict[str, LoRA]:
    linears = dict(model.named_modules(remove_duplicate=False))
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
            device, dtype = adapter_placement(linears[zoo])  # a quantized layer's: float32
            lora = blocks.build(
                "adapter", "lora", in_features=p.cols.numel(), out_features=p.rows.numel(), r=rank,
                alpha=scaling * rank, dropout=dropout,
            ).to(device=device, dtype=dtype)
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
) -> tuple[dict[str, tuple[Tensor, Tensor, float]], float, PeftTargets, bool]:
    """Check a ``peft`` LoRA config and its tensors, every field before any tensor; the LoRAs ``peft`` applies
    ``{module: (A, B, scaling)}`` (those ``target_modules``/``exclude_modules``/``layers_to_transform`` select; weights
    for modules they do not select are refused, naming them), the dropout, the targets, and whether a targeted
    module without tensors is left unchanged by ``peft`` (its ``init_lora_weights`` makes ``B = 0``)."""
    where = f"{source}: {ADAPTER_CONFIG_NAME}"
    if not isinstance(config, Mapping) or config.get("peft_type") != "LORA":
        got = config.get("peft_type") if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(f"{where} has peft_type={got!r}; only 'LORA' adapters load")
    for key, accepted in UNSUPPORTED.items():
        if config.get(key) not in accepted:
            raise ValueError(
                f"{where} sets {key}={config[key]!r}, which transformer-zoo does not implement (expected it unset"
                f"{''.join(f' or {v!r}' for v in accepted if v is not None)})"
            )
    r = _checked(config.get("r"), "r", where, rank=True)
    alpha = _checked(config.get("lora_alpha"), "lora_alpha", where, rank=False)
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{where} has lora_dropout={dropout!r}; expected a number in [0, 1)")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"{where} has use_rslora={rslora!r}; expected true or false")
    init = config.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        raise ValueError(
            f"{where} has init_lora_weights={init!r}, an initialisation that peft runs again on the base model when "
            "it loads the adapter, which transformer-zoo does not implement (expected true, false or 'gaussian')"
        )
    patterns = {}
    for field, rank in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = config.get(field) or {}
        if not isinstance(pattern, Mapping) or not all(isinstance(k, str) and k for k in pattern):
            raise ValueError(f"{where} has {field}={pattern!r}; expected an object of module patterns -> numbers")
        for key, value in pattern.items():
            check_pattern(rf"(.*\.)?({key})$", field, key, where)
            _checked(value, f"{field}[{key!r}]", where, rank=rank)
        patterns[field] = dict(pattern)
    targets = PeftTargets.from_config(config, where)

    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight", key) if isinstance(
            key, str) else None
        if match is None:
            raise ValueError(
                f"{source}: tensor {key!r} is not a LoRA weight '<module>.lora_A.weight' / '.lora_B.weight' "
                "(embedding LoRA, DoRA magnitudes and saved modules are not supported)"
            )
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point() or tensor.dim() != 2:
            got = f"a {tensor.dim()}-d {tensor.dtype} tensor" if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{source}: {key!r} is {got}; expected a 2-d floating-point tensor")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: {key!r} holds NaN or infinite values")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:
        raise ValueError(f"{source}: the adapter holds no LoRA weights")
    out, ignored = {}, []
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{source}: {module!r} has {sorted(pair)} but a LoRA needs lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{source}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; expected (r, in) "
                "and (out, r)"
            )
        if not targets.selects(module):
            ignored.append(module)
            continue
        rank_key = _pattern_key(patterns["rank_pattern"], module)
        rank = patterns["rank_pattern"][rank_key] if rank_key is not None else r
        if a.shape[0] != rank:
            field = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "r"
            raise ValueError(
                f"{source}: {module!r} has rank {a.shape[0]} but {ADAPTER_CONFIG_NAME} says {field}={rank}"
            )
        alpha_key = _pattern_key(patterns["alpha_pattern"], module)
        module_alpha = patterns["alpha_pattern"][alpha_key] if alpha_key is not None else alpha
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        out[module] = (a.float(), b.float(), scaling)
    if not out:
        raise ValueError(
            f"{where}'s target_modules={config.get('target_modules')!r} (with exclude_modules, layers_to_transform) "
            f"selects none of the modules the adapter holds weights for ({sorted(pairs)[:4]} ...)"
        )
    if ignored:  # peft would ignore them; a file peft writes never holds them: refused, not silently dropped
        shown = sorted(ignored)
        raise ValueError(
            f"{where}: target_modules/exclude_modules/layers_to_transform do not select {shown[:8]}"
            f"{f' and {len(shown) - 8} more' if len(shown) > 8 else ''}, which the adapter holds LoRA weights for; "
            "expected weights only for the modules the config targets"
        )
    return out, float(dropout), targets, init is True or init == "gaussian"


def _checked(value: Any, field: str, where: str, *, rank: bool) -> int | float:
    """A rank (an integer >= 1) or an alpha (a finite number) read from ``field``."""
    if rank and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{where} has {field}={value!r}; expected a positive integer")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} has {field}={value!r}; expected a finite number")
    return value


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
