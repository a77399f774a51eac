"""Name maps between zoo state dicts and ``transformers`` state dicts, for families that store each zoo tensor
under one ``transformers`` name (no fusing, no transposing).

A family declares which zoo module is which ``transformers`` module, outside the layers and inside one layer; the
converter then reads exactly the tensors the zoo model (built from the converted config on the meta device) has,
and the exporter writes them back under the same names. Parts that a family stores differently (fused q/k/v,
Conv1D transposes) are handled by that family's converter before or after the map.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from torch import Tensor, nn

from ..core.config import ConfigBase
from ..core.meta_build import meta_build
from .hf_checkpoint import CheckpointReader

_LAYER = re.compile(r"(?P<stack>[a-z_]*layers)\.(?P<index>\d+)\.(?P<rest>.+)\.(?P<param>weight|bias)")
_TOP = re.compile(r"(?P<module>.+)\.(?P<param>weight|bias)")


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Zoo module names -> ``transformers`` module names.

    Attributes:
        top: modules outside the layers, e.g. ``{"embed_tokens": "model.embed_tokens"}``.
        layer: modules inside a layer, e.g. ``{"self_attn.q_proj": "self_attn.q_proj"}``.
        stacks: zoo layer list -> ``transformers`` layer prefix with ``{i}``, e.g.
            ``{"layers": "model.layers.{i}"}``.
    """

    top: Mapping[str, str]
    layer: Mapping[str, str]
    stacks: Mapping[str, str]

    def to_hf(self, zoo_key: str) -> str:
        """The ``transformers`` name of a zoo state-dict key.

        Args:
            zoo_key: a key of the zoo model's state dict.

        Returns:
            Its ``transformers`` name.

        Raises:
            ValueError: a key the map does not cover (a part of the zoo model the family lacks).
        """
        match = _LAYER.fullmatch(zoo_key)
        if match and match["stack"] in self.stacks and match["rest"] in self.layer:
            prefix = self.stacks[match["stack"]].format(i=match["index"])
            return f"{prefix}.{self.layer[match['rest']]}.{match['param']}"
        match = _TOP.fullmatch(zoo_key)
        if match and match["module"] in self.top:
            return f"{self.top[match['module']]}.{match['param']}"
        raise ValueError(f"no transformers name for the zoo tensor {zoo_key!r}")


def zoo_keys(architecture: type[nn.Module], config: ConfigBase) -> list[str]:
    """The state-dict keys of ``architecture(config)``, tied copies once (built on the meta device).

    Args:
        architecture: the model class.
        config: its config.

    Returns:
        The keys, in the model's order.
    """
    with meta_build():
        model = architecture(config)
    seen: set[int] = set()
    keys = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            keys.append(name)
    return keys


def read_mapped(
    ckpt: CheckpointReader,
    names: NameMap,
    architecture: type[nn.Module],
    config: ConfigBase,
    skip: tuple[str, ...] = (),
) -> dict[str, Tensor]:
    """Take every tensor the zoo model needs from the checkpoint by the name map (``skip``: zoo keys the family
    converter fills itself).

    Args:
        ckpt: the checkpoint's tensors (each taken once).
        names: the family's name map.
        architecture: the model class.
        config: its config.
        skip: zoo keys the converter fills itself.

    Returns:
        Zoo key -> tensor.

    Shapes: tensors as stored.
    """
    return {key: ckpt.take(names.to_hf(key)) for key in zoo_keys(architecture, config) if key not in skip}


def write_mapped(state: Mapping[str, Tensor], names: NameMap, skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """The zoo state dict under ``transformers`` names (``skip``: zoo keys the family exporter writes itself).

    Args:
        state: the zoo state dict.
        names: the family's name map.
        skip: zoo keys the exporter writes itself.

    Returns:
        ``transformers`` name -> tensor.

    Shapes: tensors unchanged.
    """
    return {names.to_hf(key): tensor for key, tensor in state.items() if key not in skip}
