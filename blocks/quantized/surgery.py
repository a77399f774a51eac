"""Model surgery for quantization: swap float layers for quantized ones and back, and describe what is quantized.

``quantize_linears(model, scheme)`` replaces ``nn.Linear`` layers by the scheme's ``QuantizedLinear`` (packing their
weights); ``quantized_skeleton`` does the same without weights (before a quantized checkpoint is loaded), and also
turns ``nn.Embedding`` tables into ``QuantizedEmbedding`` (a GGUF file's token embedding stays packed; a head tied
to it is the same packed object); ``dequantize_linears`` swaps float layers back. ``quantized_modules`` names the
quantized layers a checkpoint records, and ``quantization_mismatch`` explains a state dict that is quantized where
the model is not (or the reverse).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..registry import get, names
from .base import QuantizedEmbedding, QuantizedLinear


def quantize_linears(
    module: nn.Module, scheme: str = "int8", modules: Collection[str] | None = None, **options: Any
) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (or the ones named) by the registered quantized layer ``scheme``.

    A weight shared between modules (a head tied to the embedding) is quantized as the linear layer's own copy;
    the embedding keeps its float weights. Layers that are already quantized are left as they are.

    Args:
        module: the model (or any module); a bare ``nn.Linear`` cannot replace itself, so pass its parent.
        scheme: a name of ``blocks.names("quantization")``.
        modules: names (as in ``module.named_modules()``) of the ``nn.Linear`` layers to quantize; default: all.
        **options: the scheme's options (e.g. ``group_size`` for ``int4``).

    Returns:
        ``module``, for chaining.

    Raises:
        ValueError: unknown ``scheme`` or options, a ``module`` that is itself an ``nn.Linear``, names in
            ``modules`` that are not ``nn.Linear`` layers of ``module`` (all listed), or a layer whose width the
            scheme cannot pack (named); nothing is changed then.
    """
    layer_class, linears = _linears_to_replace(module, scheme, modules)
    for name, linear in linears.items():  # every check (options against every width) before anything changes
        try:
            layer_class.check_options(linear.in_features, **options)
        except ValueError as e:
            raise ValueError(f"cannot quantize {name} ({linear.in_features} inputs) as {scheme!r}: {e}") from e
    replaced: dict[int, nn.Module] = {}
    for name, linear in linears.items():
        if id(linear) not in replaced:  # one module under two names stays one module
            replaced[id(linear)] = layer_class.from_linear(linear, **options)
        module.set_submodule(name, replaced[id(linear)])
    return module


def quantized_skeleton(
    module: nn.Module, layers: Mapping[str, str], options: Mapping[str, Mapping[str, Any]] | None = None
) -> nn.Module:
    """Replace the named float layers by quantized layers that hold no weights yet, in place.

    What ``from_pretrained`` does to a freshly built model before loading a quantized checkpoint into it: the
    result has the quantized model's structure without the work of quantizing weights that loading replaces
    anyway (the new layers hold uninitialised memory until then). An ``nn.Linear`` becomes the scheme's
    ``QuantizedLinear``, an ``nn.Embedding`` a ``QuantizedEmbedding``; a linear layer whose weight is tied to a
    named embedding's, under the same scheme, becomes that embedding's packed table (stored once, as the float
    weights were).

    Args:
        module: the model.
        layers: layer name -> scheme (a name of ``blocks.names("quantization")``).
        options: scheme -> its options (default: none).

    Returns:
        ``module``, for chaining.

    Raises:
        ValueError: an unknown scheme, names that are not ``nn.Linear`` / ``nn.Embedding`` layers of ``module``
            (all listed), or options a layer's width does not allow; nothing is changed then.
    """
    options = dict(options or {})
    children = dict(module.named_modules(remove_duplicate=False))
    absent = sorted(n for n in layers if type(children.get(n)) not in (nn.Linear, nn.Embedding))
    if isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError("quantized_skeleton replaces children: pass the module that holds the layers")
    if absent:
        raise ValueError(f"cannot quantize {_listing(absent)}: not nn.Linear or nn.Embedding layers of this "
                         f"{type(module).__name__}")
    built: dict[str, nn.Module] = {}
    tables: dict[tuple[int, str], QuantizedLinear] = {}  # (id of a float weight, scheme) -> its packed table
    for name in sorted(layers, key=lambda n: type(children[n]) is not nn.Embedding):  # embeddings first
        scheme, child = layers[name], children[name]
        layer_class = _scheme_class(scheme)
        scheme_options = dict(options.get(scheme, {}))
        if isinstance(child, nn.Embedding):
            table = layer_class(child.embedding_dim, child.num_embeddings, bias=False, **scheme_options)
            tables[(id(child.weight), scheme)] = table.to(child.weight.device)
            built[name] = QuantizedEmbedding(tables[(id(child.weight), scheme)])
        elif (id(child.weight), scheme) in tables and child.bias is None:
            built[name] = tables[(id(child.weight), scheme)]
        else:
            layer = layer_class(child.in_features, child.out_features, bias=child.bias is not None, **scheme_options)
            built[name] = layer.to(child.weight.device)
    for name, layer in built.items():
        module.set_submodule(name, layer)
    return module


def packable_schemes() -> list[str]:
    """The schemes whose ``from_float`` packs float weights (``quantize_linears`` / ``model.quantize`` take them).

    Returns:
        Their names.
    """
    return [name for name in names("quantization") if get("quantization", name).has_quantizer]


def _scheme_class(scheme: str) -> type[QuantizedLinear]:
    if not isinstance(scheme, str) or scheme not in names("quantization"):
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {names('quantization')}")
    return get("quantization", scheme)


def _linears_to_replace(
    module: nn.Module, scheme: str, modules: Collection[str] | None
) -> tuple[type[QuantizedLinear], dict[str, nn.Linear]]:
    """The registered layer class of ``scheme`` and the ``nn.Linear`` layers to replace, by name (checked)."""
    layer_class = _scheme_class(scheme)
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
    return layer_class, linears


def dequantize_linears(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer inside ``module`` by a float ``nn.Linear`` (``nn.Embedding``) holding the
    weights it represents.

    The replaced layers compute the quantized model's function up to float rounding. A head that is the packed
    table of a quantized embedding becomes an ``nn.Linear`` tied to the new embedding; other ties broken by
    quantization (a head quantized apart from its float embedding) stay broken.

    Args:
        module: the model (or any module holding quantized layers).
        dtype: floating dtype of the new layers (default: each layer's bias dtype, else float32).

    Returns:
        ``module``, for chaining.
    """
    children = list(module.named_modules(remove_duplicate=False))
    embeddings: dict[int, nn.Embedding] = {}
    for name, child in children:
        if name and isinstance(child, QuantizedEmbedding):
            embedding = child.to_embedding(dtype)
            embeddings[id(child.table)] = embedding
            module.set_submodule(name, embedding)
    linears: dict[int, nn.Linear] = {}
    for name, child in children:
        if not name or not isinstance(child, QuantizedLinear) or _is_table_name(name, children):
            continue
        if id(child) not in linears:
            linear = child.to_linear(dtype)
            if id(child) in embeddings:  # the head tied to the packed embedding: tied to the float one
                linear.weight = embeddings[id(child)].weight
            linears[id(child)] = linear
        module.set_submodule(name, linears[id(child)])
    return module


def _is_table_name(name: str, children: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``name`` is the ``table`` of a ``QuantizedEmbedding`` (replaced with its embedding)."""
    parent, _, leaf = name.rpartition(".")
    return leaf == "table" and isinstance(dict(children).get(parent), QuantizedEmbedding)


def scheme_of(module: nn.Module) -> str | None:
    """The registered quantization scheme ``module`` is a layer (or an embedding) of, or ``None`` for any other.

    Args:
        module: any module.

    Returns:
        The scheme's name, or None.
    """
    if isinstance(module, QuantizedEmbedding):
        module = module.table
    if isinstance(module, QuantizedLinear) and module.scheme in names("quantization"):
        return module.scheme
    return None


def quantized_modules(module: nn.Module) -> dict[str, str]:
    """Name -> scheme of every quantized layer and embedding inside ``module`` (under each name it is registered
    by; an embedding's ``table`` is named by the embedding).

    Args:
        module: a model.

    Returns:
        Module name -> scheme.
    """
    children = list(module.named_modules(remove_duplicate=False))
    found = {}
    for name, child in children:
        scheme = scheme_of(child)
        if scheme is not None and not _is_table_name(name, children):
            found[name] = scheme
    return found


def quantization_options(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Scheme -> options of the quantized layers inside ``module`` (schemes without options are left out).

    Args:
        module: a model.

    Returns:
        The options per scheme.

    Raises:
        ValueError: two layers of one scheme with different options (a checkpoint records one set per scheme).
    """
    found: dict[str, dict[str, Any]] = {}
    for name, child in module.named_modules():
        if isinstance(child, QuantizedLinear) and child.options():
            seen = found.setdefault(child.scheme, child.options())
            if seen != child.options():
                raise ValueError(f"layers quantized as {child.scheme!r} with different options ({seen} and "
                                 f"{child.options()} at {name}); a checkpoint records one set of options per scheme")
    return found


def state_names_of(module: nn.Module) -> tuple[str, ...]:
    """The packed tensors' names, relative to ``module`` (a quantized layer or embedding).

    Args:
        module: a quantized layer or embedding.

    Returns:
        The names (``table.``-prefixed for an embedding).
    """
    if isinstance(module, QuantizedEmbedding):
        return tuple(f"table.{n}" for n in module.table.state_names)
    return tuple(module.state_names)


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

    A layer the state dict holds quantized (every one of a scheme's packed tensors present) where ``module`` has
    an ``nn.Linear`` or ``nn.Embedding``, or a quantized layer of ``module`` of which the state dict holds none of
    the packed tensors (it is unquantized), is a mismatch. Only the first kind found is described, with every
    layer of that kind counted and the scheme named.

    Args:
        module: the model the state dict is for.
        keys: the state dict's keys.

    Returns:
        The explanation, or None.
    """
    keys = set(keys)
    quantized_in_state: dict[str, tuple[str, tuple[str, ...]]] = {}
    float_in_state: dict[str, tuple[str, tuple[str, ...]]] = {}
    quantized = quantized_modules(module)
    for name, child in module.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if name in quantized:
            state_names = state_names_of(child)
            # Not one of the layer's packed tensors: an unquantized checkpoint (its float weight may be absent
            # too, when it is a head stored once as the tied embedding).
            if not any(prefix + n in keys for n in state_names):
                float_in_state[name] = (quantized[name], state_names)
        elif type(child) in (nn.Linear, nn.Embedding) and f"{prefix}weight" not in keys:
            table = "table." if type(child) is nn.Embedding else ""
            for candidate in names("quantization"):
                state_names = tuple(table + n for n in get("quantization", candidate).state_names)
                if state_names and all(prefix + n in keys for n in state_names):
                    quantized_in_state[name] = (candidate, state_names)
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


def _summary(layers: dict[str, tuple[str, tuple[str, ...]]]) -> tuple[str, str, str]:
    """For messages about ``layers`` (name -> (scheme, packed tensor names)): the schemes listed, the first
    layer's packed tensor names, and the first scheme."""
    schemes = sorted({scheme for scheme, _ in layers.values()})
    first = next(iter(layers))
    tensors = ", ".join(f"{first}.{n}" for n in layers[first][1])
    return _listing([repr(s) for s in schemes]), tensors, layers[first][0]


def _listing(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
