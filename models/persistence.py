"""Persistence: safetensors checkpoints and the Hugging Face Hub (mixed into the model classes)."""

from __future__ import annotations


class PersistenceMixin:
    """``save_pretrained``, ``from_pretrained`` and ``push_to_hub``."""
