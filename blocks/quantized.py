"""Weight-only int8 linear layers for decoding: weights read at one byte each.

Decoding one token at a time is bound by reading the weights, so storing them as int8 with one float scale per
output channel (symmetric, ``w ≈ scale[o] · q[o, i]`` with ``q`` in [-127, 127]) reads a quarter of the bytes of
float32. Activations stay in floating point (weight-only quantization, as in LLM.int8's weight storage or
gpt-fast's int8 mode); the error per weight is at most ``scale / 2 = max|w[o]| / 254``.

``torchao`` is not installed with this torch (2.13, CPU), so the layer is implemented here. Registered as
``blocks.get("quantization", "int8")``; ``quantize_linears(module, "int8")`` swaps every ``nn.Linear`` in place
and ``dequantize_linears`` swaps them back (float ``nn.Linear`` layers holding ``scale · q``).

Checkpoints: a quantized layer's state is its ``state_names`` (``weight_int8`` int8 ``(out, in)``, ``scale`` float
``(out,)``) plus ``bias``; ``quantized_modules`` names the quantized layers a checkpoint records, and
``quantization_mismatch`` explains a state dict that is quantized where the model is not (or the reverse).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import get, names, register
from .small_matmul import MAX_ROWS, small_rows_linear


@register("quantization", "int8")
class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and a float32 scale per output channel.

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: whether there is a (float) bias.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    #: the tensors (besides ``bias``) that a checkpoint of this scheme holds per layer; a state dict with them
    #: under a layer's name was written from a quantized layer.
    state_names: ClassVar[tuple[str, ...]] = ("weight_int8", "scale")

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear``'s weight per output channel (symmetric, round to nearest).

        Raises:
            ValueError: ``linear`` is not an ``nn.Linear``.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach().float()
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None).to(weight.device)
        # A row of zeros would give scale 0 and 0 / 0 below; any positive scale represents it exactly.
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        out.weight_int8.copy_(torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        out.scale.copy_(scale)
        if linear.bias is not None:
            out.bias.data = linear.bias.detach().clone()
        return out

    def dequantized_weight(self) -> Tensor:
        """The float32 weight the int8 values represent, ``(out_features, in_features)``."""
        return self.weight_int8.float() * self.scale[:, None]

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A float ``nn.Linear`` holding ``scale[o] · q[o, i]`` (and the bias): the inverse of ``from_linear`` up to
        the rounding it did.

        Args:
            dtype: floating dtype of the new layer (default: the bias's dtype, else the scale's).

        Raises:
            ValueError: ``dtype`` is not a floating dtype.
        """
        if dtype is None:
            dtype = self.bias.dtype if self.bias is not None else self.scale.dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"to_linear needs a floating dtype, got {dtype!r}")
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.scale.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.dequantized_weight())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling() and flat.shape[0] <= MAX_ROWS and not torch.is_grad_enabled():
            # Inductor fuses the int8 -> float conversion into the reduction: one pass over the int8 weight,
            # nothing the size of the float weight is written (see blocks.small_matmul).
            y = small_rows_linear(flat, self.weight_int8, scale=self.scale)
        elif flat.shape[0] == 1 and flat.device.type != "cpu":
            # The GPU kernel for int8 weights × float activations (no float copy of the weight).
            y = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale.to(flat.dtype))
        else:
            # On CPU that kernel is slower than a float copy of this one weight and BLAS, even for one row (a
            # 8192 × 512 head on 2 cores: 2.9 against 1.9 ms), and it runs one row at a time (the 25 weights of a
            # 6 × 512 decoder: 534 ms for a 32-token prefill, against 24 ms). The scale is per output channel, so
            # it applies after the product.
            y = F.linear(flat, self.weight_int8.to(flat.dtype)) * self.scale.to(flat.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*rows, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: nn.Module, scheme: str = "int8", modules: Collection[str] | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (or the ones named) by the registered quantized layer ``scheme``.

    A weight shared between modules (a head tied to the embedding) is quantized as the linear layer's own copy;
    the embedding keeps its float weights. Layers that are already quantized are left as they are.

    Args:
        module: the model (or any module); a bare ``nn.Linear`` cannot replace itself, so pass its parent.
        scheme: a name of ``blocks.names("quantization")``.
        modules: names (as in ``module.named_modules()``) of the ``nn.Linear`` layers to quantize; default: all.

    Returns:
        ``module``, for chaining.

    Raises:
        ValueError: unknown ``scheme``, a ``module`` that is itself an ``nn.Linear``, or names in ``modules`` that
            are not ``nn.Linear`` layers of ``module`` (all listed); nothing is changed then.
    """
    layer_class, linears = _linears_to_replace(module, scheme, modules)
    for name, linear in linears.items():
        module.set_submodule(name, layer_class.from_linear(linear))
    return module


def quantized_skeleton(module: nn.Module, scheme: str, modules: Collection[str]) -> nn.Module:
    """Replace the named ``nn.Linear`` layers by quantized layers of ``scheme`` that hold no weights yet, in place.

    What ``from_pretrained`` does to a freshly built model before loading a quantized checkpoint into it: the
    result has the quantized model's structure (``quantize_linears``) without the work of quantizing weights that
    loading replaces anyway (the new layers hold zeros until then).

    Args:
        module: the model.
        scheme: a name of ``blocks.names("quantization")``.
        modules: names of the ``nn.Linear`` layers to replace.

    Returns:
        ``module``, for chaining.

    Raises:
        ValueError: as ``quantize_linears``.
    """
    layer_class, linears = _linears_to_replace(module, scheme, modules)
    for name, linear in linears.items():
        layer = layer_class(linear.in_features, linear.out_features, bias=linear.bias is not None)
        module.set_submodule(name, layer.to(linear.weight.device))
    return module


def _linears_to_replace(
    module: nn.Module, scheme: str, modules: Collection[str] | None
) -> tuple[type[nn.Module], dict[str, nn.Linear]]:
    """The registered layer class of ``scheme`` and the ``nn.Linear`` layers to replace, by name (checked)."""
    if scheme not in names("quantization"):
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {names('quantization')}")
    if isinstance(module, nn.Linear):
        raise ValueError("quantize_linears replaces children: pass the module that holds the nn.Linear")
    # remove_duplicate=False: a linear module registered under two names is replaced under both.
    linears = {name: child for name, child in module.named_modules(remove_duplicate=False) if type(child) is nn.Linear}
    if modules is not None:
        if isinstance(modules, str) or not all(isinstance(name, str) for name in modules):
            raise ValueError(f"modules must be a collection of module names, got {modules!r}")
        absent = sorted(set(modules) - set(linears))
        if absent:
            raise ValueError(
                f"cannot quantize {_listing(absent)}: not nn.Linear layers of this {type(module).__name__} "
                f"(it has {len(linears)} nn.Linear layers, e.g. {_listing(sorted(linears), 3)})"
            )
        linears = {name: linears[name] for name in modules}
    return get("quantization", scheme), linears


def dequantize_linears(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer inside ``module`` by a float ``nn.Linear`` holding the weights it represents.

    The replaced layers compute the quantized model's function up to float rounding (``x · (s·q)ᵀ`` instead of
    ``(x · qᵀ) · s``); ties broken by quantization (a head tied to the embedding) stay broken.

    Args:
        module: the model (or any module holding quantized layers).
        dtype: floating dtype of the new layers (default: each layer's bias dtype, else its scale's).

    Returns:
        ``module``, for chaining.
    """
    for name, child in list(module.named_modules(remove_duplicate=False)):
        if name and scheme_of(child) is not None:
            module.set_submodule(name, child.to_linear(dtype))
    return module


def scheme_of(module: nn.Module) -> str | None:
    """The registered quantization scheme ``module`` is a layer of, or ``None`` for any other module."""
    for scheme in names("quantization"):
        if type(module) is get("quantization", scheme):
            return scheme
    return None


def quantized_modules(module: nn.Module) -> dict[str, str]:
    """Name -> scheme of every quantized layer inside ``module`` (under each name it is registered by)."""
    found = {}
    for name, child in module.named_modules(remove_duplicate=False):
        scheme = scheme_of(child)
        if scheme is not None:
            found[name] = scheme
    return found


def check_unquantized(module: nn.Module, action: str) -> None:
    """Refuse ``action`` (an export to a float format, e.g. ``transformers``) for a module holding quantized layers.

    Args:
        module: the model.
        action: what is refused, for the message (``"export to transformers"``).

    Raises:
        ValueError: naming the scheme, the layers and the fix (``model.dequantize()``).
    """
    layers = quantized_modules(module)
    if layers:
        schemes = _listing(sorted({repr(s) for s in layers.values()}))
        raise ValueError(
            f"cannot {action}: this {type(module).__name__} has {len(layers)} layer(s) quantized as {schemes} "
            f"({_listing(list(layers), 3)}), which that format has no place for; call model.dequantize() first "
            "(float layers holding scale · q, the same function up to float rounding)"
        )


def quantization_mismatch(module: nn.Module, keys: Iterable[str]) -> str | None:
    """Why a state dict with ``keys`` cannot load into ``module`` because of quantization, or ``None`` if it can.

    A layer the state dict holds quantized (every one of its scheme's ``state_names`` present) where ``module`` has
    an ``nn.Linear``, or a quantized layer of ``module`` of which the state dict holds none of the quantized tensors
    (it is unquantized), is a mismatch.
    Only the first kind found is described, with every layer of that kind counted and the scheme named.
    """
    keys = set(keys)
    quantized_in_state: dict[str, str] = {}
    float_in_state: dict[str, str] = {}
    for name, child in module.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        scheme = scheme_of(child)
        if scheme is not None:
            state_names = get("quantization", scheme).state_names
            # Not one of the layer's quantized tensors: an unquantized checkpoint (its float weight may be absent
            # too, when it is a head stored once as the tied embedding).
            if not any(prefix + n in keys for n in state_names):
                float_in_state[name] = scheme
        elif type(child) is nn.Linear and f"{prefix}weight" not in keys:
            for candidate in names("quantization"):
                if all(prefix + n in keys for n in get("quantization", candidate).state_names):
                    quantized_in_state[name] = candidate
                    break
    model = type(module).__name__
    if quantized_in_state:
        schemes, tensors, scheme = _summary(quantized_in_state)
        return (
            f"it holds {len(quantized_in_state)} layer(s) quantized as {schemes} ({tensors}, ...), but those layers "
            f"of the {model} are unquantized nn.Linear layers: quantize the model first (model.quantize({scheme!r})); "
            "from_pretrained does this when config.json records the quantization"
        )
    if float_in_state:
        schemes, tensors, _ = _summary(float_in_state)
        return (
            f"it holds float weights, not the quantized tensors ({tensors}, ...), for {len(float_in_state)} "
            f"layer(s) that the {model} has quantized as {schemes}: load them into an unquantized model (and "
            "quantize it after loading), or call model.dequantize() first"
        )
    return None


def _summary(layers: dict[str, str]) -> tuple[str, str, str]:
    """For messages about ``layers`` (name -> scheme): the schemes listed, the first layer's quantized tensor names,
    and the first scheme."""
    schemes = sorted(set(layers.values()))
    first = next(iter(layers))
    tensors = ", ".join(f"{first}.{n}" for n in get("quantization", schemes[0]).state_names)
    return _listing([repr(s) for s in schemes]), tensors, schemes[0]


def _listing(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
