"""The contract every weight-only quantization scheme fulfils (registered under kind ``quantization``).

A scheme is a subclass of ``QuantizedLinear`` registered with ``@register("quantization", name)``. It stores a
``(out_features, in_features)`` weight as packed tensors and provides, all on the same object:

- **pack** — ``from_float(weight, bias, **options)`` (and ``from_linear``): quantize a float weight;
- **unpack** — ``unpack(rows=None)``: the float32 weight the packed tensors represent, exactly (the same bits on
  every call, every device and inside compiled graphs); ``rows`` selects output rows (an embedding's gather);
- **linear forward** — ``forward(x)`` = ``F.linear(x, unpack(), bias)`` up to float32 rounding, never expanding the
  whole weight to float32 at once (eager: ``CHUNK_ELEMENTS`` at a time or a packed-weight kernel; compiled: the
  unpacking is fused into the product's loop);
- **embedding forward** — ``embed(ids)``: rows of ``unpack()`` gathered (``QuantizedEmbedding`` wraps it);
- **bytes read** — ``nbytes()``: what one forward reads (the packed tensors and the bias);
- **state-dict layout** — ``state_names``: the packed tensors, each with ``out_features`` rows first (so an
  embedding's gather and a row permutation are plain indexing of every tensor), saved and loaded bit-identically;
  kernel-specific layouts derived from them are caches, never state.

Schemes with options (an int4 group size) take them as keyword arguments of ``__init__`` and ``from_float`` and
report them in ``options()``; the checkpoint's ``config.json`` records them (``models.checkpoints.persistence``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..small_matmul import MAX_ROWS, small_rows_linear

#: Float32 elements of weight an eager forward unpacks at a time (16 MiB): the most a forward ever holds unpacked.
CHUNK_ELEMENTS = 1 << 22


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored packed by a quantization scheme (subclasses implement ``pack`` and
    ``decode``; everything else is shared).

    Args:
        in_features: as ``nn.Linear``.
        out_features: as ``nn.Linear``.
        bias: whether there is a float bias.
        **options: the scheme's options (see ``options()``).

    A freshly built layer is a skeleton: its packed tensors have their checkpoint shapes and are uninitialised (as
    ``torch.empty``: no memory is touched, so a model built to be loaded costs nothing) until a state dict is
    loaded (``quantized_skeleton``) or ``from_float`` fills them.

    Raises:
        ValueError: a size that is not a positive int, or bad options.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    #: the registry name of the scheme (set by subclasses).
    scheme: ClassVar[str] = ""
    #: the packed tensors (buffers, ``out_features`` rows first) a checkpoint holds per layer, besides ``bias``.
    state_names: ClassVar[tuple[str, ...]] = ()
    #: whether ``from_float`` can pack a float weight (the GGUF K-quants are only loaded from files).
    has_quantizer: ClassVar[bool] = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **options: Any) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self._options = self.check_options(in_features, **options)
        for name, (shape, dtype) in self.packed_shapes(in_features, out_features, **self._options).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    # ---- what a scheme implements -------------------------------------------------------------------------------

    @classmethod
    def check_options(cls, in_features: int, **options: Any) -> dict[str, Any]:
        """The scheme's options, checked against ``in_features`` and completed with defaults.

        Args:
            in_features: the layer's input width.
            **options: the options given.

        Returns:
            The complete options.

        Raises:
            ValueError: an unknown option or a bad value (named), e.g. a group size that does not divide the width.
        """
        if options:
            raise ValueError(f"quantization scheme {cls.scheme!r} takes no options, got {sorted(options)}")
        return {}

    @classmethod
    def packed_shapes(cls, in_features: int, out_features: int, **options: Any) -> dict[str, tuple[tuple, Any]]:
        """``state_names`` -> (shape, dtype) of a layer of this size.

        Args:
            in_features: the input width.
            out_features: the output width.
            **options: the checked options.

        Returns:
            Each packed tensor's shape and dtype.

        Raises:
            NotImplementedError: on the base class.
        """
        raise NotImplementedError

    @classmethod
    def pack(cls, weight: Tensor, **options: Any) -> dict[str, Tensor]:
        """The packed tensors of a float weight (``options`` already checked).

        Args:
            weight: the float weight.
            **options: the checked options.

        Returns:
            ``state_names`` -> packed tensor.

        Raises:
            NotImplementedError: on the base class.

        Shapes: weight ``(out, in)``.
        """
        raise NotImplementedError

    @classmethod
    def decode(cls, packed: dict[str, Tensor], in_features: int, **options: Any) -> Tensor:
        """The float32 weight of packed tensors holding ``rows`` output rows; pure torch, so inductor can fuse it into
        a product.

        Args:
            packed: ``state_names`` -> packed tensor (of ``rows`` rows).
            in_features: the input width.
            **options: the checked options.

        Returns:
            The float32 weight.

        Raises:
            NotImplementedError: on the base class.

        Shapes: -> ``(rows, in_features)``.
        """
        raise NotImplementedError

    # ---- shared ----------------------------------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The scheme's options (JSON values), as ``config.json`` records them.

        Returns:
            Option name -> value.
        """
        return dict(self._options)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None, **options: Any) -> QuantizedLinear:
        """Quantize a float ``(out_features, in_features)`` weight (and keep ``bias`` as it is).

        Args:
            weight: the float weight.
            bias: the float bias, or None.
            **options: the scheme's options.

        Returns:
            The packed layer.

        Shapes: weight ``(out_features, in_features)``, bias ``(out_features,)``.

        Raises:
            ValueError: ``weight`` is not a 2-d floating tensor, has non-finite values, or bad ``options``.
        """
        if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            got = f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"{cls.__name__}.from_float needs a 2-d floating weight, got {got}")
        weight = weight.detach()
        if not bool(torch.isfinite(weight).all()):
            raise ValueError(f"{cls.__name__}.from_float: the weight {tuple(weight.shape)} has non-finite values; "
                             "expected finite floats")
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, **options).to(weight.device)
        packed = cls.pack(weight.float(), **layer._options)
        for name in cls.state_names:
            getattr(layer, name).copy_(packed[name])
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> QuantizedLinear:
        """Quantize ``linear``'s weight (see ``from_float``).

        Args:
            linear: the float layer.
            **options: the scheme's options.

        Returns:
            The packed layer.

        Raises:
            ValueError: ``linear`` is not an ``nn.Linear``, or as ``from_float``.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        return cls.from_float(linear.weight, linear.bias, **options)

    def packed(self, rows: Tensor | slice | None = None) -> dict[str, Tensor]:
        """The packed tensors (``state_names``), restricted to output ``rows`` (indices or a slice) when given.

        Args:
            rows: output rows to keep, or None for all.

        Returns:
            ``state_names`` -> packed tensor.

        Shapes: rows ``(R,)`` long.
        """
        if rows is None:
            return {name: getattr(self, name) for name in self.state_names}
        return {name: getattr(self, name)[rows] for name in self.state_names}

    def unpack(self, rows: Tensor | slice | None = None) -> Tensor:
        """The float32 weight, exactly as packed.

        Args:
            rows: output rows to unpack, or None for all.

        Returns:
            The weight.

        Shapes: -> ``(out_features, in_features)``, or ``(R, in_features)`` for ``R`` rows.
        """
        return self.decode(self.packed(rows), self.in_features, **self._options)

    def dequantized_weight(self) -> Tensor:
        """The float32 weight the packed values represent (``unpack()``).

        Returns:
            The weight ``(out_features, in_features)``.

        Shapes: -> ``(out_features, in_features)``.
        """
        return self.unpack()

    def nbytes(self) -> int:
        """Bytes one forward reads: every packed tensor and the bias.

        Returns:
            The byte count.
        """
        tensors = [getattr(self, name) for name in self.state_names]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def linear(self, x: Tensor) -> Tensor:
        """``x @ unpack().T`` for ``x`` of shape ``(rows, in_features)``, without the bias.

        Compiled and few rows (decoding): the unpacking written inline so that inductor fuses it into the
        reduction (one pass over the packed bytes). Otherwise the weight is unpacked ``CHUNK_ELEMENTS`` at a time
        and multiplied by BLAS. Schemes with a packed-weight kernel override this.

        Args:
            x: the inputs.

        Returns:
            The product.

        Shapes: x ``(rows, in_features)`` -> ``(rows, out_features)``.
        """
        if torch.compiler.is_compiling() and x.shape[0] <= MAX_ROWS and not torch.is_grad_enabled():
            return small_rows_linear(x, self.unpack())
        return self.in_chunks(CHUNK_ELEMENTS, lambda a, b: F.linear(x, self.unpack(slice(a, b)).to(x.dtype)))

    def in_chunks(self, elements: int, product: Callable[[int, int], Tensor]) -> Tensor:
        """``product(start, stop)`` (the outputs ``start:stop`` of a product) over consecutive runs of output rows
        holding at most ``elements`` weights (at least one row each), concatenated: the most of the weight an eager
        product unpacks at a time.

        Args:
            elements: weights per run at most.
            product: computes the outputs ``start:stop``.

        Returns:
            The whole product.

        Shapes: each ``product`` ``(rows, stop - start)`` -> ``(rows, out_features)``.
        """
        step = max(1, elements // self.in_features)
        pieces = [product(start, min(start + step, self.out_features)) for start in range(0, self.out_features, step)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects inputs (..., {self.in_features}), got {tuple(x.shape)}")
        rows = x.shape[:-1]
        y = self.linear(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*rows, self.out_features)

    def embed(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` of the weight, unpacked (an embedding lookup on the packed table).

        Args:
            ids: the rows.

        Returns:
            The rows, float32.

        Shapes: ``ids (...)`` long -> ``(..., in_features)`` float32.
        """
        flat = ids.reshape(-1)
        return self.unpack(flat).reshape(*ids.shape, self.in_features)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A float ``nn.Linear`` holding ``unpack()`` (and the bias).

        Args:
            dtype: floating dtype of the new layer (default: the bias's dtype, else float32).

        Returns:
            The float layer.

        Raises:
            ValueError: ``dtype`` is not a floating dtype.
        """
        if dtype is None:
            dtype = self.bias.dtype if self.bias is not None else torch.float32
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"to_linear needs a floating dtype, got {dtype!r}")
        device = getattr(self, self.state_names[0]).device
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=device,
                           dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.unpack())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        # model.to(dtype) / model.half() cast floating buffers; packed tensors keep their dtype and values (a float16
        # block scale is part of the format; through bfloat16 and back it would be rounded), only their device follows.
        before = {name: getattr(self, name) for name in self.state_names}
        super()._apply(fn, recurse)
        for name, tensor in before.items():
            after = getattr(self, name)
            if after.dtype != tensor.dtype:
                setattr(self, name, tensor.to(after.device))
        return self

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self._options.items())
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                f"{options}")


class QuantizedEmbedding(nn.Module):
    """An embedding table stored packed: ``forward(ids)`` unpacks only the rows gathered.

    Args:
        table: the packed ``(num_embeddings, embedding_dim)`` table, a ``QuantizedLinear`` (a head tied to the
            embedding is the same object, so the two stay tied and are stored once).

    Raises:
        ValueError: a table that is not a ``QuantizedLinear``.

    Shapes: ``ids (...)`` -> ``(..., embedding_dim)``.
    """

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        if not isinstance(table, QuantizedLinear):
            raise ValueError(f"QuantizedEmbedding needs a QuantizedLinear table, got {type(table).__name__}")
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # An empty float tensor that model.to(dtype) casts like the model's floats: the dtype rows come out in.
        self.register_buffer("dtype_probe", torch.zeros(0), persistent=False)

    @property
    def weight(self) -> Tensor:
        """The first packed tensor (for its device; the float table is ``table.unpack()``)."""
        return getattr(self.table, self.table.state_names[0])

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.embed(ids).to(self.dtype_probe.dtype)

    def to_embedding(self, dtype: torch.dtype | None = None) -> nn.Embedding:
        """A float ``nn.Embedding`` holding the unpacked table.

        Args:
            dtype: its floating dtype (default float32).

        Returns:
            The float embedding.
        """
        embedding = nn.Embedding(self.num_embeddings, self.embedding_dim, device=self.weight.device,
                                 dtype=dtype or torch.float32)
        with torch.no_grad():
            embedding.weight.copy_(self.table.unpack())
        return embedding

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.table.scheme!r}"


class PackedWeight(Tensor):
    """A meta-device stand-in for a float ``(out, in)`` weight that a file holds packed in a quantization scheme.

    A reader (``models.gguf``) puts one in a state dict where the float weight would be; converters pass it along
    under its new name like any tensor (it has the float weight's shape and dtype, on the meta device), and the
    loader then gives the named layer the scheme's packed tensors (``load_state()``) instead of a float weight.
    An operation on it (a transpose, a concatenation) gives a plain meta tensor, so a converter that changes a
    weight's values is noticed, and the loader uses ``materialize()`` (the float weight) for that tensor instead.
    ``make`` builds one.
    """

    # Operations give plain tensors: only the object a reader made carries ``scheme`` and the loaders.
    __torch_function__ = torch._C._disabled_torch_function_impl

    scheme: str
    load_state: Any
    materialize: Any

    @staticmethod
    def make(shape: tuple[int, ...], scheme: str, load_state: Any, materialize: Any) -> PackedWeight:
        """Build a stand-in.

        Args:
            shape: the float weight's shape.
            scheme: a name of ``blocks.names("quantization")``.
            load_state: returns the scheme's packed tensors (``state_names`` -> tensor) for this weight.
            materialize: returns the float32 weight (a dequantized copy).

        Returns:
            The stand-in, on the meta device.
        """
        weight = Tensor._make_subclass(PackedWeight, torch.empty(shape, device="meta"))
        weight.scheme, weight.load_state, weight.materialize = scheme, load_state, materialize
        return weight
