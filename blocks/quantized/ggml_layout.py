"""How the GGUF block formats' fields are laid out while they decode (``BlockLayout``), what a format decodes to
(``Codes``), and the block-shaped product inductor fuses (``fused_block_linear``); used by ``ggml`` and
``ggml_formats``."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


def f32(t: Tensor) -> Tensor:
    """``t`` as float32.

    Args:
        t: any tensor.

    Returns:
        The float32 copy (``t`` itself when it is float32).

    Shapes: any -> same.
    """
    return t.to(torch.float32)


class BlockLayout:
    """How the weights of ``rows`` packed rows of ``blocks`` blocks are laid out while a format decodes them. Every
    tensor has ``2 + len(block_shape)`` dimensions, in one of two orders:

    - blocks (``planes=False``): ``(rows, blocks, *block_shape)``, each block's weights in order (unpacking, and
      the compiled product, where inductor then loads every scale once per contiguous run);
    - planes (``planes=True``): ``(rows, *block_shape[:-1], blocks, block_shape[-1])``: a row's weights grouped by
      their position in the block (the nibble, the bit plane, the run), so that the shifts that pick bits and most
      scales broadcast over long contiguous stretches, where eager kernels are fast (over runs of 16 they are up to
      10x slower); the eager product multiplies the inputs taken in the same order.

    Elementwise operations commute with the reordering, so a format writes its decoding once, on tensors from
    ``field``, ``small`` and ``bits``.

    Args:
        rows: rows of the packed tensors.
        blocks: blocks per row of the packed tensors.
        block_shape: the format's ``block_shape``.
        planes: the planes order.
    """

    def __init__(self, rows: int, blocks: int, block_shape: tuple[int, ...], planes: bool = False) -> None:
        self.rows, self.blocks, self.planes = rows, blocks, planes
        self.ndim = 2 + len(block_shape)
        self.order = (0, *range(2, self.ndim - 1), 1, self.ndim - 1) if planes else tuple(range(self.ndim))

    def place(self, t: Tensor) -> Tensor:
        """A full-rank tensor in the blocks order, in this layout (planes: contiguous, a copy where it moves data).

        Args:
            t: a tensor of ``ndim`` dimensions in the blocks order.

        Returns:
            ``t`` in this layout.

        Shapes: ``(rows, blocks, ...)`` -> the same dimensions, permuted for planes.
        """
        return t.permute(self.order).contiguous() if self.planes else t

    def field(self, t: Tensor, *shape: int) -> Tensor:
        """A packed field seen block by block.

        Args:
            t: the packed field.
            *shape: each block's part of it.

        Returns:
            The view (placed in this layout).

        Shapes: ``(rows, blocks · prod(shape))`` -> ``(rows, blocks, 1, ..., *shape)``.
        """
        return self.place(t.view(self.rows, self.blocks, *([1] * (self.ndim - 2 - len(shape))), *shape))

    def small(self, t: Tensor, *shape: int) -> Tensor:
        """A per-block tensor (unpacked scales) seen as ``(rows, blocks, *shape)``, padded as ``field``.

        Args:
            t: the per-block values.
            *shape: each block's part of them.

        Returns:
            The view.

        Shapes: ``(rows, blocks, ...)`` -> ``(rows, blocks, 1, ..., *shape)``.
        """
        return self.field(t.reshape(self.rows, self.blocks * math.prod(shape)), *shape)

    def word(self, t: Tensor, count: int, k: int) -> Tensor:
        """Word ``k`` of the ``count`` words per block of a packed field, broadcast over the block.

        Args:
            t: the packed field.
            count: words per block.
            k: the word.

        Returns:
            The word of every block.

        Shapes: ``(rows, blocks · count)`` -> ``(rows, blocks, 1, ..., 1)``.
        """
        return self.small(t.view(self.rows, self.blocks, count)[:, :, k], *([1] * (self.ndim - 2)))

    def index(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """``0, 1, ...`` over the per-block ``shape`` (like ``bits``' shifts), placed against full-rank tensors.

        Args:
            shape: the per-block shape.
            like: gives the dtype and device.

        Returns:
            The indices.

        Shapes: -> ``(1, 1, ..., *shape)``.
        """
        i = _shifts(shape, 1, like)
        return self.place(i.view(*([1] * (self.ndim - i.dim())), *shape))

    def bits(self, t: Tensor, shape: tuple[int, ...], step: int, mask: int) -> Tensor:
        """``(t >> shift) & mask`` with ``shift = step · i``, ``i`` counting 0, 1, ... over the per-block ``shape``
        (an ``arange``, never a tensor constant: inductor loses constants inside some compiled subgraphs).

        In the blocks order an 8-bit ``t`` gives float32 (the same integers): ``float(t & (mask << shift)) ·
        2^-shift``, exact. Compiled, 8-bit shifts are emulated by shuffles (AVX-512 has none), and converting
        bytes to 32-bit integers goes element by element when inductor takes 32 at a time; masking bytes and
        converting them to float is vectorised.

        Args:
            t: the packed integers.
            shape: the per-block shape the shifts count over.
            step: bits per shift.
            mask: the bits kept.

        Returns:
            The selected bits (float32 for 8-bit ``t`` in the blocks order).

        Shapes: ``t`` broadcast against ``(1, 1, ..., *shape)``.
        """
        shift = _shifts(shape, step, t)
        shift = self.place(shift.view(*([1] * (self.ndim - shift.dim())), *shape))
        if not self.planes and t.element_size() == 1:
            return f32(t & (mask << shift)) * (1.0 / f32(1 << shift))
        return (t >> shift) & mask


def _shifts(shape: tuple[int, ...], step: int, like: Tensor) -> Tensor:
    """``step · arange`` of ``shape``, in ``like``'s dtype and device."""
    return (torch.arange(math.prod(shape), dtype=like.dtype, device=like.device) * step).view(shape)


class Codes(NamedTuple):
    """A block format's weights as ``scale · (q - zero) + offset``: ``q`` integers, ``zero`` a constant, ``scale``
    and ``offset`` float32 per run of weights (broadcast), all in one ``BlockLayout``."""

    q: Tensor
    zero: int
    scale: Tensor
    offset: Tensor | None = None

    def weights(self) -> Tensor:
        """The float32 weights, bit for bit as ``gguf.quants``: ``q - zero`` is exact in float32, then one rounding
        for the product and one for the offset (``a - b`` and ``a + (-b)`` round alike).

        Returns:
            The weights.

        Shapes: -> the codes' block shape.
        """
        q = f32(self.q) - self.zero if self.zero else f32(self.q)
        w = self.scale * q
        return w if self.offset is None else w + self.offset

    def scaled(self, integer_zero: bool = False) -> tuple[Tensor, Tensor | None]:
        """For a product: ``(scale · (q - zero), offset)``: the weights before their offsets (the same bits as in
        ``weights()``), and the offsets, which then multiply sums of inputs over each run instead of every weight.

        Args:
            integer_zero: subtract ``zero`` before converting ``q`` to float (one pass over bytes instead of floats:
                faster in eager mode; compiled, the float subtraction vectorises better).

        Returns:
            ``(scaled codes, offsets or None)``.

        Shapes: -> the codes' block shape.
        """
        if not self.zero:
            q = f32(self.q)
        elif integer_zero:  # every code is below 128, so int8 holds it and the difference
            q = f32((self.q.to(torch.int8) if self.q.dtype == torch.uint8 else self.q) - self.zero)
        else:
            q = f32(self.q) - self.zero
        return self.scale * q, self.offset




def fused_block_linear(x: Tensor, weights: Tensor, offsets: Tensor | None = None,
                       order: tuple[int, ...] | None = None) -> Tensor:
    """``x @ W.T`` for ``W = weights + offsets`` given block-shaped (``GGMLLinear.codes(...).scaled()`` in the blocks
    order), written so that inductor computes each weight inside the reduction: for every output row, the input row's
    matching runs times the weights, the blocks' dimensions kept apart so that every scale is loaded once per run,
    and the offsets times the runs' input sums. In eager mode this materialises ``rows × out × in`` products:
    compile it.

    Args:
        x: ``(rows, in)`` float32.
        weights: ``(out, blocks, *block_shape)`` float32 with ``blocks · prod(block_shape) = in``.
        offsets: optional float32 per run, broadcastable to ``(out, blocks, *block_shape[:-1], 1)``.
        order: a permutation of ``block_shape``'s dimensions for the loops: inductor merges two dimensions that
            every tensor reads contiguously and vectorises 32 weights at a time where the inputs hold float16
            scales, converting 32 bytes to 32-bit integers one by one (Q4_K: 5x slower than 16 at a time).

    Returns:
        ``(rows, out)`` float32.

    Raises:
        ValueError: ``x`` does not fit ``weights``.

    Shapes: x ``(rows, in)``, weights ``(out, blocks, *block_shape)`` -> ``(rows, out)``.
    """
    block_dims = tuple(weights.shape[1:])
    if x.dim() != 2 or x.shape[1] != weights[0].numel():
        raise ValueError(f"fused_block_linear needs x (rows, {weights[0].numel()}) for weight blocks "
                         f"{tuple(weights.shape)}, got x {tuple(x.shape)}")
    xb = x.reshape(1, x.shape[0], *block_dims)
    dims = tuple(range(2, 2 + len(block_dims)))
    if order is not None:
        xb = xb.permute(0, 1, 2, *(3 + i for i in order))
        weights = weights.permute(0, 1, *(2 + i for i in order))
    y = (xb * weights[:, None]).sum(dims)  # (out, rows)
    if offsets is not None:
        y = y + (xb.sum(-1, keepdim=True) * offsets[:, None]).sum(dims)
    return y.t()


# ---- the 32-weight formats ---------------------------------------------------------------------------------------


