"""Conversion between ``transformers`` checkpoints and zoo models.

- ``registry`` — ``register_converter``, ``from_transformers``: a checkpoint's ``config.json`` and tensors to a zoo
  architecture, config and state dict.
- ``export`` — ``register_exporter``, ``to_transformers``, ``save_transformers``: the other direction.
- ``hf_checkpoint`` and ``name_maps`` — what converters share: reading a ``transformers`` config and checkpoint,
  and tensor-name maps that work both ways.
- ``<family>.py`` — one module per family (``llama``, ``bert``, ``t5``, ...): its converter, exporter and presets.
  ``models/__init__`` imports every family by name; this package's ``__init__`` imports none.
"""

from .export import NotExportable, register_exporter, save_transformers, to_transformers
from .registry import (
    CONVERTER_KIND,
    Converted,
    check_converted,
    from_transformers,
    register_converter,
    supported_model_types,
)

__all__ = [
    "CONVERTER_KIND",
    "Converted",
    "NotExportable",
    "check_converted",
    "from_transformers",
    "register_converter",
    "register_exporter",
    "save_transformers",
    "supported_model_types",
    "to_transformers",
]
