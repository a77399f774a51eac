"""``quantize()`` and ``dequantize()``: weight-only quantization for every model class (see ``blocks.quantized``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from blocks.moe import MixtureOfExperts
from blocks.quantized import dequantize_linears, quantize_linears, quantized_modules


class QuantizeMixin:
    """``quantize`` and ``dequantize`` for every family: weight-only quantization for decoding (int8, group-wise
    int4, ...; see ``blocks.quantized``).

    A quantized model saves, loads and pushes like any other: ``config.json`` records the scheme and the quantized
    layers (see ``models.checkpoints.persistence``), and ``from_pretrained`` quantizes the freshly built model
    before loading.
    """

    def quantize(self, scheme: str = "int8", **options: Any) -> nn.Module:
        """Store every linear layer's weight packed by the quantization scheme ``scheme``, in place.

        Meant for inference (decoding reads each weight once per token: ``"int8"`` reads a quarter of float32's
        bytes, ``"int4"`` about an eighth); the quantized layers hold buffers, not trainable parameters. A head tied
        to the embedding gets its own packed copy; the embedding stays float. Mixture-of-experts routers stay
        float, as llama.cpp keeps ``ffn_gate_inp``: they are a sliver of the weights, and rounding their logits
        changes which experts a token goes to.

        Args:
            scheme: a name of ``blocks.names("quantization")`` (``"int8"``, ``"int4"`` ...).
            **options: the scheme's options, e.g. ``model.quantize("int4", group_size=64, symmetric=True)``;
                ``config.json`` records them when the model is saved.

        Returns:
            The model itself.

        Raises:
            ValueError: unknown ``scheme`` or options, or a layer whose width the options do not allow (an int4 group
                size that does not divide its ``in_features``: named); nothing is changed then.
            ImportError: torchao, which packs the weights, is not installed.
        """
        routers = {f"{name}.router" for name, module in self.named_modules() if isinstance(module, MixtureOfExperts)}
        linears = [name for name, module in self.named_modules(remove_duplicate=False)
                   if type(module) is nn.Linear and name not in routers]
        return quantize_linears(self, scheme, linears, **options)

    def dequantize(self) -> nn.Module:
        """Replace every quantized layer by a float ``nn.Linear`` holding the weights it represents (``unpack()``:
        ``scale · q`` for int8), in place.

        The model then computes what the quantized one did, up to float rounding, and can be trained, exported
        to ``transformers`` or quantized again. The float weights are the rounded ones: the original weights are
        not recovered. A head quantized apart from its float embedding (``quantize``) keeps its own dequantized
        weights, so ``config.tie_embeddings`` becomes ``False`` and the model saves and loads as an untied one; a
        head that is the packed table of a quantized embedding (a GGUF file's tied head) stays tied to it.

        Returns:
            The model itself.

        Raises:
            ValueError: the model has no quantized layers.
        """
        quantized = quantized_modules(self)
        if not quantized:
            raise ValueError(
                f"this {type(self).__name__} has no quantized layers to dequantize; expected a model quantized with "
                "model.quantize(...) or loaded from a quantized checkpoint"
            )
        # The model's float dtype, taken from its float parameters (embeddings, norms), so the new layers match it.
        dtypes = [p.dtype for p in self.parameters() if p.is_floating_point()]
        dtype = max(set(dtypes), key=dtypes.count) if dtypes else None
        dequantize_linears(self, dtype)
        if getattr(self.config, "tie_embeddings", False) and self._ties_broken():
            self.config = self.config.replace(tie_embeddings=False)
        return self

    def _ties_broken(self) -> bool:
        """Whether a parameter that a model built from the config shares between names is not shared here."""
        with torch.device("meta"):  # no memory, no initialisation work: only the tying structure is wanted
            fresh = type(self)(self.config)
        groups: dict[int, list[str]] = {}
        for name, p in fresh.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        own = dict(self.named_parameters(remove_duplicate=False))
        return any(len({id(own.get(n)) for n in names}) > 1 for names in groups.values() if len(names) > 1)
