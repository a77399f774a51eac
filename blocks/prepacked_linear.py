"""Float32 linear layers whose weights are held in oneDNN's blocked layout, for serving on the CPU.

Decoding 16 rows at a time multiplies them by every weight. oneDNN's product reads a plain ``(out, in)`` weight
reordering its blocks as it goes; the same weight reordered once, ahead of time, into the layout its kernel reads
(``torch.ops.mkldnn._reorder_linear_weight``) is read 6–16% faster at 16 rows (Qwen3-0.6B's layer shapes, 28 layers,
float32, one core: ``benchmarks.decode_products`` has a ``prepacked`` column). The reordered weight takes the same
bytes and serves every row count, so ``prepack_linears`` replaces a model's weights by it rather than keeping both
(as vLLM's CPU backend and llama.cpp's repacked CPU buffers do). The price: one row reads the blocked layout
1.2–1.5× slower than BLAS reads the plain one.

``PrepackedLinear`` keeps ``nn.Linear``'s interface (``in_features``, ``out_features``, ``bias``) and its state-dict
names: ``state_dict()`` writes the weight back in the plain layout, ``load_state_dict`` reorders what it is given.
It is for inference (no gradient reaches the weight). Inside a compiled graph or an exported program the product
is the custom op ``zoo::prepacked_linear``, which finds its weight by the layer's ``handle`` (a one-element buffer,
the graph's input): an AOTInductor package cannot hold oneDNN's opaque tensors, but takes the handles as
constants like any buffer, so a package compiled from one model runs on another's packed weights.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

#: Rows the weights' layout is chosen for (the engine's batches of decoding rows; any row count runs).
PACK_ROWS = 16
#: The smallest weight ``prepack_linears`` packs by default (elements), set by the price, one row's product. Measured
#: per shape on one core (a stack of 28–30 copies): weights of 1024 × 1024 and more take 1.16–1.34× BLAS's time at
#: one row and gain 1.06–1.24× over oneDNN on the plain layout at 16; smaller ones take 1.24–1.77× at one row (a
#: call's fixed cost weighs more) for a like gain. End to end, SmolLM2-135M's shape (all under 2^20) lost 29% on a lone
#: request and gained 1% at 16 in flight; Qwen3-0.6B's (all above) lost 16–19% and gained 3–9%.
MIN_ELEMENTS = 2**20

_handles = itertools.count(1)
_layers: weakref.WeakValueDictionary[int, PrepackedLinear] = weakref.WeakValueDictionary()


def prepacking_available() -> bool:
    """Whether this build of torch has oneDNN (``torch.backends.mkldnn``), which ``PrepackedLinear`` needs.

    Returns:
        True where it is built in.
    """
    return torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Module):
    """``nn.Linear``'s product with its float32 weight held in oneDNN's blocked layout (see the module docstring).

    Args:
        linear: the layer to take the weight and bias from: float32, on the CPU (the weight is reordered into new
            memory; the layer is not changed).

    Raises:
        RuntimeError: torch is built without oneDNN.
        ValueError: a weight that is not a float32 CPU matrix.

    Shapes: x ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not prepacking_available():
            raise RuntimeError("PrepackedLinear needs torch built with oneDNN (torch.backends.mkldnn.is_available())")
        weight = linear.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PrepackedLinear packs a float32 CPU weight matrix, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = _pack(weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.handle: Tensor
        handle = next(_handles)
        self.register_buffer("handle", torch.tensor([handle], dtype=torch.int64))
        _layers[handle] = self
        self._register_state_dict_hook(_plain_weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Reorder a plain ``weight`` into the layout (the handle stays this layer's), then load the bias."""
        weight = state_dict.pop(prefix + "weight", None)
        if weight is None:
            missing_keys.append(prefix + "weight")
        elif tuple(weight.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape {tuple(weight.shape)}, "
                              f"the shape in the current model is {(self.out_features, self.in_features)}.")
        else:
            self._packed = _pack(weight.to(torch.float32))
        state_dict[prefix + "handle"] = self.handle
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __deepcopy__(self, memo: dict[int, Any]) -> PrepackedLinear:
        """A copy with its own reordered weight and its own handle (oneDNN's opaque tensors have no storage to copy,
        and a shared handle would make compiled graphs of the copy read this layer's weight)."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        memo[id(self)] = clone = PrepackedLinear(plain)
        clone.train(self.training)
        return clone

    @property
    def weight_nbytes(self) -> int:
        """The bytes of the weight, as the plain one's (torch reports no padding the blocked layout may add)."""
        return self._packed.nbytes

    def dense_weight(self) -> Tensor:
        """The weight in the plain ``(out, in)`` layout (a new tensor).

        Returns:
            The weight.

        Shapes: -> ``(out_features, in_features)``.
        """
        return self._packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # a graph input (the handle), not oneDNN's opaque tensor
            return torch.ops.zoo.prepacked_linear(x, self.handle, self.out_features)
        return _product(x, self._packed, self.bias, self.out_features)


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _product(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    if x.shape[:-1].numel() == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _plain_weight(module: PrepackedLinear, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the weight under ``nn.Linear``'s name, in the plain layout, after it the bias; no handle."""
    state.pop(prefix + "handle", None)
    bias = state.pop(prefix + "bias", None)
    state[prefix + "weight"] = module.dense_weight()
    if bias is not None:
        state[prefix + "bias"] = bias


@torch.library.custom_op("zoo::prepacked_linear", mutates_args=())
def prepacked_linear(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    """The product of the ``PrepackedLinear`` whose handle is ``handle`` (a compiled graph's or a package's call).

    Args:
        x: the input.
        handle: the layer's ``handle`` buffer.
        out_features: the layer's output width (the output's shape without running it).

    Returns:
        ``layer(x)``.

    Raises:
        KeyError: no live ``PrepackedLinear`` has that handle.

    Shapes: x ``(..., in_features)`` -> ``(..., out_features)``.
    """
    key = int(handle.reshape(-1)[0])
    layer = _layers.get(key)
    if layer is None:
        raise KeyError(f"no PrepackedLinear with handle {key} is alive in this process")
    return _product(x, layer._packed, layer.bias, out_features)


@prepacked_linear.register_fake
def _(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def prepack_linears(model: nn.Module, *, min_elements: int | None = None,
                    names: Sequence[str] | None = None) -> list[str]:
    """Replace the plain ``nn.Linear`` layers of ``model`` with float32 CPU weights of at least ``min_elements``
    elements by ``PrepackedLinear`` layers, in place.

    Skipped: a weight shared with another tensor of the model (a head tied to the embeddings, which must keep its
    rows), a subclass of ``nn.Linear`` or a layer with hooks (adapters), weights of other dtypes or devices, and
    small weights (a call into oneDNN costs more than BLAS's on a small matrix). If any layer was packed, the
    model's other parameters and buffers are then copied into new memory, so that nothing keeps the memory the old
    weights were read from (a checkpoint file mapped into memory, which reading every weight to reorder it made
    resident) alive.

    Args:
        model: the model (eval mode; it is changed).
        min_elements: the smallest weight packed (default ``MIN_ELEMENTS``).
        names: exactly these layers instead (what ``prepack_linears`` returned for another instance of the model).

    Returns:
        The names of the layers packed.

    Raises:
        RuntimeError: torch is built without oneDNN.
        ValueError: a name in ``names`` that is not a plain float32 linear layer of ``model``.
    """
    if not prepacking_available():
        raise RuntimeError("packing weights needs torch built with oneDNN (torch.backends.mkldnn.is_available())")
    chosen = [name for name in prepackable(model, min_elements=0 if names is not None else min_elements)
              if model.get_submodule(name).weight.device.type == "cpu"]
    if names is not None:
        if not set(names) <= set(chosen):
            raise ValueError(f"not plain float32 linear layers of the model: {sorted(set(names) - set(chosen))}")
        chosen = [name for name in chosen if name in names]
    for name in chosen:
        owner, _, attribute = name.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(parent, attribute, PrepackedLinear(getattr(parent, attribute)))
    if chosen:
        with torch.no_grad():
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                tensor.data = tensor.data.clone()
    return chosen


def prepackable(model: nn.Module, *, min_elements: int | None = None) -> list[str]:
    """The layers ``prepack_linears`` would pack, without changing anything: plain ``nn.Linear`` layers without hooks,
    with float32 CPU weights of at least ``min_elements`` elements that no other tensor of the model shares. A model
    on the meta device (read for its config only) is taken as it would load onto the CPU.

    Args:
        model: the model.
        min_elements: the smallest weight counted (default ``MIN_ELEMENTS``).

    Returns:
        The layers' names.
    """
    smallest = MIN_ELEMENTS if min_elements is None else min_elements
    owners: dict[int, int] = {}
    for _, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                     model.named_buffers(remove_duplicate=False)):
        owners[_owner(tensor)] = owners.get(_owner(tensor), 0) + 1
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and module.weight.dtype == torch.float32 and module.weight.device.type in ("cpu", "meta")
            and owners[_owner(module.weight)] == 1 and module.weight.numel() >= smallest]


def _owner(tensor: Tensor) -> int:
    """What tells shared tensors apart: their memory, or on the meta device (which has none) the tensor itself."""
    return id(tensor) if tensor.device.type == "meta" else tensor.untyped_storage().data_ptr()
