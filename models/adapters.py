"""Adapters (LoRA) on zoo models: ``add_adapter``, ``merge_adapter``, ``save_adapter``, ``load_adapter``."""

from __future__ import annotations


class AdapterMixin:
    """Adapter methods mixed into every zoo model (see ``ZooModel``)."""
