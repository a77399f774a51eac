"""Loading a checkpoint with another head than it was saved with: ``from_pretrained(path, head=..., num_labels=...)``.

``with_head`` gives the loaded config the requested head and options, drops the checkpoint's tensors of a head the
model no longer has (or of another shape), and lists the new head's weights for initialisation with a warning that
names them, as ``transformers`` warns when a base checkpoint gets a task head.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..core.meta_build import meta_build

#: the modules a model's head lives under (task heads, the MLM head, the LM projection).
HEAD_MODULES = ("head.", "mlm_head.", "lm_head.")


def with_head(
    cls: type[nn.Module], config: Any, state: Mapping[str, Tensor], allow_missing: frozenset[str],
    head: str | None, options: Mapping[str, Any] | None, source: str,
) -> tuple[Any, dict[str, Tensor], frozenset[str]]:
    """The config, state and allowed-missing names for loading ``state`` into ``cls`` with another head.

    Args:
        cls: the model class.
        config: the checkpoint's config.
        state: the checkpoint's tensors, in the model's naming.
        allow_missing: names that may be absent already.
        head: the registered head (None: the checkpoint's).
        options: head options; merged over the checkpoint's when the head is the same.
        source: names the checkpoint in the warnings.

    Returns:
        ``(config, state, allow_missing)``: the config with the head, ``state`` without the head tensors the new
        head does not take (absent or of another shape), and ``allow_missing`` with the new head's tensors.

    Raises:
        ValueError: a head or options the model class refuses (named by the config's validation), or a model
            class that takes no head option.

    Shapes: state's tensors keep their shapes.
    """
    if not hasattr(config, "head"):
        raise ValueError(f"{cls.__name__} takes no head option; its head is fixed")
    name = config.head if head is None else head
    merged = dict(config.options.get("head", {})) if name == config.head else {}
    merged.update(options or {})
    block_options = {k: v for k, v in config.options.items() if k != "head"}
    if merged:
        block_options["head"] = merged
    new_config = config.replace(head=name, options=block_options)
    with meta_build():
        expected = cls(new_config).state_dict()
    kept, dropped = {}, []
    for key, tensor in state.items():
        if key.startswith(HEAD_MODULES) and (key not in expected or tuple(expected[key].shape) != tuple(tensor.shape)):
            dropped.append(key)
        else:
            kept[key] = tensor
    fresh = sorted(k for k in expected if k.startswith(HEAD_MODULES) and k not in kept)
    if dropped:
        warnings.warn(f"{source}: the {name!r} head does not use the checkpoint's {sorted(dropped)}", stacklevel=4)
    if fresh:
        warnings.warn(
            f"Some weights of {cls.__name__} were not initialized from the checkpoint at {source} and are newly "
            f"initialized: {fresh}; train the model on a down-stream task before using it for predictions",
            stacklevel=4,
        )
    return new_config, kept, frozenset(allow_missing) | frozenset(fresh)
