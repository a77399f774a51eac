"""``ModelSource``: how the engine process (``serving.engine_process``) gets its model: a checkpoint to load, or a
picklable factory (``ModelSource.from_model`` makes one from a model in memory), quantized or dequantized as asked
(``serving.loading``).
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Callable
from typing import Any

import torch

from blocks.quantized import quantization_options, quantized_modules, quantized_skeleton

from .loading import apply_quantization, check_quantization, check_request, load_model


def rebuild_model(cls: type, config: dict[str, Any], weights: bytes, quantized: dict[str, str] | None = None,
                  quantization: dict[str, dict[str, Any]] | None = None) -> Any:
    """A model of class ``cls`` from its config's ``to_dict()`` and its state dict saved by ``torch.save``; the layers
    named in ``quantized`` (name -> scheme, ``blocks.quantized.quantized_modules``) quantized first, with the schemes'
    ``quantization`` options (``quantization_options``), so that the packed tensors load into them.

    Args:
        cls: the model's class (with a ``config_class``).
        config: its config as ``to_dict()`` wrote it.
        weights: its state dict as ``torch.save`` wrote it.
        quantized: the quantized layers, name -> scheme (None: none).
        quantization: the schemes' options (``blocks.quantized.quantization_options``).

    Returns:
        The model, in eval mode.
    """
    model = cls(cls.config_class.from_dict(config))
    if quantized:
        quantized_skeleton(model, quantized, quantization)
    model.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    return model.eval()


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """How the engine process gets its model: exactly one of ``path`` and ``factory``.

    Attributes:
        path: a checkpoint folder, Hub repo id or ``.gguf`` file for ``models.from_pretrained(path, **options)``.
        options: ``models.from_pretrained`` options (``dtype``, ``revision``, ``gguf_file`` …).
        factory: a picklable callable without arguments returning the model (a module-level function, or a
            ``functools.partial`` of one).
        quantize: quantize the loaded float model's weights with this scheme (``blocks.names("quantization")``).
        dequantize: unpack a quantized model's weights to float32 (see ``serving.loading``).

    Raises:
        ValueError: neither or both of ``path`` and ``factory``, a factory that is not callable, an unknown
            ``quantize`` scheme, or ``quantize`` with ``dequantize``.
    """

    path: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    factory: Callable[[], Any] | None = None
    quantize: str | None = None
    dequantize: bool = False

    def __post_init__(self) -> None:
        check_request(self.quantize, self.dequantize)
        if (self.path is None) == (self.factory is None):
            raise ValueError(f"ModelSource takes a path or a factory, exactly one; got path={self.path!r}, "
                             f"factory={self.factory!r}")
        if self.factory is not None and not callable(self.factory):
            raise ValueError(f"ModelSource's factory must be callable, got {type(self.factory).__name__}")

    @classmethod
    def from_model(cls, model: Any) -> ModelSource:
        """A source that rebuilds ``model`` (its class, config, quantized layers and a copy of its weights, packed as
        they are) in the engine process; for models made in memory (tests, examples). Adapted models: merge or save
        them and give the path.

        Args:
            model: the model to copy.

        Returns:
            A source whose factory is ``rebuild_model`` on that copy.
        """
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        return cls(factory=functools.partial(rebuild_model, type(model), model.config.to_dict(), buffer.getvalue(),
                                             quantized_modules(model), quantization_options(model)))

    def build(self) -> Any:
        """Load or make the model (in the engine process), quantized or dequantized as asked.

        Returns:
            The model.
        """
        if self.path is not None:
            return load_model(self.path, quantize=self.quantize, dequantize=self.dequantize, **self.options)
        model = self.factory()
        check_quantization(model, "the factory's model", self.quantize, self.dequantize)
        return apply_quantization(model, self.quantize, self.dequantize)

