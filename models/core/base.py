"""``ZooModel``: the base class of every model class — presets, backend switching, input checks, adapters and
quantization (the last two mixed in from ``models.core.adapters`` and ``models.core.quantize``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks

from .adapters import AdapterMixin
from .config import ConfigBase
from .presets import PresetTable
from .quantize import QuantizeMixin


class ZooModel(AdapterMixin, QuantizeMixin, nn.Module):
    """Base class of the zoo's models.

    Subclasses set ``config_class`` and ``presets`` (name -> config overrides, kept as a ``PresetTable``: any case,
    ``-`` or ``_``) and build themselves from ``config`` alone.

    Args:
        config: an instance of the class's ``config_class``.

    Raises:
        TypeError: a config of another class.
    """

    config_class: ClassVar[type[ConfigBase]] = ConfigBase
    presets: ClassVar[dict[str, dict[str, Any]]] = PresetTable()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "presets" in cls.__dict__ and not isinstance(cls.presets, PresetTable):
            cls.presets = PresetTable(cls.presets)  # names found whatever their case and - or _ (preset_key)

    def __init__(self, config: ConfigBase) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ZooModel:
        """Build a model from a named preset, with any config field overridden.

        Args:
            name: a registered preset (``tiny``, ``llama-tiny``, ``bert-base`` ...).
            **overrides: config fields to change, e.g. ``vocab_size=300``.

        Returns:
            The model, randomly initialised.

        Raises:
            ValueError: unknown preset (the valid names are listed) or unknown/invalid overrides.
        """
        return cls(cls.preset_config(name, **overrides))

    @classmethod
    def preset_config(cls, name: str, **overrides: Any) -> ConfigBase:
        """The config of a preset, with overrides applied (no model is built).

        Args:
            name: a registered preset.
            **overrides: config fields to change.

        Returns:
            The validated config.

        Raises:
            ValueError: unknown preset (the valid names are listed) or unknown/invalid overrides.
        """
        if name not in cls.presets:
            raise cls.presets.unknown(name, cls.__name__) if isinstance(cls.presets, PresetTable) else ValueError(
                f"unknown {cls.__name__} preset {name!r}; expected one of {sorted(cls.presets)}")
        return cls.config_class.from_dict({**cls.presets[name], **overrides})

    @classmethod
    def register_preset(cls, name: str, config: dict[str, Any]) -> None:
        """Add a named preset (a family's ``tiny`` test size or a published model's size); the config is validated.

        Args:
            name: the preset's name.
            config: config fields, as ``config_class.from_dict`` takes them.

        Raises:
            ValueError: the name is taken, or the config is invalid.
        """
        if name in cls.presets:
            raise ValueError(f"{cls.__name__} preset {name!r} already exists")
        cls.config_class.from_dict(config)
        cls.presets[name] = dict(config)

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention module to the registered backend ``name`` (a runtime choice).

        Args:
            name: ``math``, ``sdpa``, ``flex``, ``chunked`` or another registered ``attention_backend``.
        """
        blocks.get("attention_backend", name)  # validates the name before anything changes
        for module in self.modules():
            if isinstance(module, (blocks.MultiHeadAttention, blocks.MultiHeadLatentAttention)):
                module.set_backend(name)
        self.config = self.config.replace(attention_backend=name)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied weights counted once).

        Returns:
            The count.
        """
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ input checks
    def check_ids(self, ids: Tensor, name: str) -> None:
        """Check that ``ids`` is a ``(B, L)`` integer tensor of ids in ``[0, vocab_size)``.

        Args:
            ids: the token ids.
            name: the argument's name, for the message.

        Raises:
            ValueError: another shape or dtype, or an id outside the vocabulary (naming it; the value check is
                skipped under ``torch.compile``).

        Shapes: ids ``(B, L)``.
        """
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be a (B, L) tensor of token ids, got {shape}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        # Value checks read tensor data; under torch.compile they would break the graph, so they are skipped.
        if ids.numel() and not torch.compiler.is_compiling():
            vocab = self.config.vocab_size
            outside = (ids < 0) | (ids >= vocab)
            if bool(outside.any()):  # one host sync per call; the offending id is looked up only on error
                bad = int(ids[outside][0])
                raise ValueError(f"{name} contains id {bad}, outside the vocabulary [0, vocab_size={vocab})")

    @staticmethod
    def check_mask(mask: Tensor | None, shape: tuple[int, ...], name: str) -> Tensor | None:
        """Validate a ``(B, L)`` padding mask (True/1 = real token) and return it as bool.

        Args:
            mask: the mask, or None.
            shape: the ids' shape it must have.
            name: the argument's name, for the message.

        Returns:
            The bool mask, or None.

        Raises:
            ValueError: another shape, a float dtype, or integers other than 0/1.

        Shapes: mask ``(B, L)`` -> ``(B, L)`` bool.
        """
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{name} must have shape {tuple(shape)} (B, L) matching the ids, got {got}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_floating_point or (
                not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all())
            ):
                raise ValueError(f"{name} must be bool or 0/1 integers (1 = real token), got dtype {mask.dtype}")
            mask = mask.bool()
        return mask
