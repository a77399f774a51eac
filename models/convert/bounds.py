"""Count fields bounded by what a checkpoint stores, before anything is built from them.

Every count a ``transformers`` config holds (experts, labels and label-map sizes, widths, heads, vocabulary:
``HF_COUNT_FIELDS``) may be at most the largest tensor dimension, or the most indices stored under one name
(``...experts.<e>.*``), of its checkpoint; positions at most ``MAX_POSITIONS``. A zoo checkpoint's block options
(``n_experts``, ``num_labels`` ...) likewise. Each check is O(tensors + fields) whatever the config says, and runs
before a converter loops over experts, a label map is built or a model is built (even on the meta device).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..core.config import MAX_POSITIONS, ConfigBase

#: ``transformers`` config fields that count something every checkpoint stores: each is at most the largest dimension
#: of a stored tensor or the most indices stored under one name (``experts.<e>``), whatever the family.
HF_COUNT_FIELDS = (
    "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "num_labels",
    "vocab_size", "hidden_size", "n_embd", "d_model", "dim", "num_attention_heads", "n_head", "n_heads",
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim", "d_ff", "d_kv",
    "hidden_dim", "type_vocab_size", "kv_lora_rank", "q_lora_rank", "n_group", "topk_group",
)
#: ``transformers`` config fields counting positions (rotary ones store no tensor): at most ``MAX_POSITIONS``.
HF_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "original_max_position_embeddings", "n_ctx")
#: zoo block options that count stored things (``n_experts``) or labels, bounded like ``HF_COUNT_FIELDS``.
ZOO_COUNT_OPTIONS = ("n_experts", "top_k", "num_labels", "d_shared", "n_group", "topk_group", "kv_lora_rank",
                     "q_lora_rank")
#: label maps: their length is a count too (a map of 10**6 entries is refused without being read).
LABEL_MAPS = ("id2label", "label2id")
_NUMBERED = re.compile(r"\.(\d+)(?=\.|$)")


def stored_bound(state: Mapping[str, Tensor]) -> int:
    """The largest count a config may claim for ``state``: the largest dimension of a stored tensor, or the most
    indices stored under one name (``...experts.<e>.*``, ``layers.<i>.*``), whichever is larger. O(tensors).

    Args:
        state: the checkpoint's tensors by name.

    Returns:
        The bound.

    Shapes: any tensors.
    """
    largest = max((max(t.shape, default=1) for t in state.values() if isinstance(t, Tensor)), default=1)
    indices: dict[str, set[int]] = {}
    for name in state:
        if isinstance(name, str):
            for match in _NUMBERED.finditer(name):
                indices.setdefault(name[:match.start()], set()).add(int(match[1]))
    return max(largest, max((len(v) for v in indices.values()), default=0))


def check_hf_counts(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> None:
    """Refuse a ``transformers`` config (or a nested ``*_config`` of it) whose counts exceed what its checkpoint
    stores (``HF_COUNT_FIELDS``, ``id2label``/``label2id`` sizes) or whose positions exceed ``MAX_POSITIONS``.

    Cost O(tensors + fields), before a converter loops over experts or builds a label map.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors (any shapes).

    Shapes: any tensors.

    Raises:
        ValueError: naming the field, its value and the bound.
    """
    bound = stored_bound(state_dict)
    model_type = hf_config.get("model_type")
    configs = [("", hf_config)] + [
        (f"{key}.", value) for key, value in hf_config.items() if key.endswith("_config") and isinstance(value, Mapping)
    ]
    for prefix, config in configs:
        for field in HF_COUNT_FIELDS:
            _check_count(f"{model_type} config field {prefix}{field}", config.get(field), bound,
                         "the largest tensor dimension or index count the checkpoint stores")
        for field in LABEL_MAPS:
            if isinstance(config.get(field), Mapping):
                _check_count(f"{model_type} config field {prefix}{field} (its size)", len(config[field]), bound,
                             "the largest tensor dimension the checkpoint stores")
        for field in HF_POSITION_FIELDS:
            _check_count(f"{model_type} config field {prefix}{field}", config.get(field), MAX_POSITIONS,
                         "MAX_POSITIONS")


def check_zoo_counts(config: ConfigBase, state: Mapping[str, Tensor], source: str = "") -> None:
    """Refuse a zoo config whose block options count more than its checkpoint stores (``ZOO_COUNT_OPTIONS``, the
    sizes of label maps), before a model (even on the meta device) is built. O(tensors + options).

    Args:
        config: the zoo config.
        state: the checkpoint's tensors (any shapes).
        source: where they come from, for messages.

    Shapes: any tensors.

    Raises:
        ValueError: naming the option (``options['ffn'].n_experts``), its value and the bound.
    """
    bound, prefix = stored_bound(state), f"{source}: " if source else ""
    entries = [("options", getattr(config, "options", {}) or {})] + [
        (f"layer_options[{i}]", entry) for i, entry in enumerate(getattr(config, "layer_options", ()) or ())
    ]
    for where, options in entries:
        for block, values in options.items():
            if not isinstance(values, Mapping):
                continue
            for key in ZOO_COUNT_OPTIONS:
                _check_count(f"{prefix}config {where}[{block!r}].{key}", values.get(key), bound,
                             "the largest tensor dimension or index count the checkpoint stores")
            for key in LABEL_MAPS:
                if isinstance(values.get(key), Mapping):
                    _check_count(f"{prefix}config {where}[{block!r}].{key} (its size)", len(values[key]),
                                 bound, "the largest tensor dimension the checkpoint stores")


def _check_count(what: str, value: Any, bound: int, bound_name: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value > bound:
        raise ValueError(f"{what}={value} exceeds {bound_name} ({bound}): the config and the weights disagree")


__all__ = ["HF_COUNT_FIELDS", "HF_POSITION_FIELDS", "LABEL_MAPS", "MAX_POSITIONS", "ZOO_COUNT_OPTIONS",
           "check_hf_counts", "check_zoo_counts", "stored_bound"]
