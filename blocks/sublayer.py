"""The residual connection around each sublayer (paper §3.1, §5.4): post-norm, pre-norm or sandwich-norm.

A layer uses a sublayer connection in two steps around the sublayer (attention or FFN)::

    h = connection.normalize(x)      # the sublayer's input
    h = attention(h)
    x = connection.residual(x, h)    # dropout, residual sum (and the norms that come after)
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from .registry import register


class SublayerConnection(nn.Module):
    """Dropout, a residual connection and a normalisation around one sublayer.

    Args:
        norm: the normalisation module (owned by this connection, named ``norm`` in checkpoints).
        dropout: dropout applied to the sublayer output before the residual sum (§5.4).
    """

    def __init__(self, norm: nn.Module, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = norm
        self.dropout = nn.Dropout(dropout)

    def normalize(self, x: Tensor) -> Tensor:
        """The sublayer's input, from the residual stream.

        Args:
            x: the residual stream.

        Returns:
            What the sublayer reads.

        Raises:
            NotImplementedError: on the base class.

        Shapes: ``(B, L, d_model)`` -> same.
        """
        raise NotImplementedError

    def residual(self, x: Tensor, out: Tensor) -> Tensor:
        """The new residual stream from the old one and the sublayer's output.

        Args:
            x: the residual stream.
            out: the sublayer's output.

        Returns:
            The new residual stream.

        Raises:
            NotImplementedError: on the base class.

        Shapes: x, out ``(B, L, d_model)`` -> ``(B, L, d_model)``.
        """
        raise NotImplementedError


@register("sublayer", "post_norm")
class PostNorm(SublayerConnection):
    """``LayerNorm(x + Dropout(Sublayer(x)))`` — the paper's arrangement."""

    def normalize(self, x: Tensor) -> Tensor:
        return x

    def residual(self, x: Tensor, out: Tensor) -> Tensor:
        return self.norm(x + self.dropout(out))


@register("sublayer", "pre_norm")
class PreNorm(SublayerConnection):
    """``x + Dropout(Sublayer(Norm(x)))`` — trains deep stacks without warm-up (Xiong et al. 2020);
    a model built from it needs a final norm after the last layer."""

    def normalize(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def residual(self, x: Tensor, out: Tensor) -> Tensor:
        return x + self.dropout(out)


@register("sublayer", "sandwich_norm")
class SandwichNorm(PreNorm):
    """``x + Dropout(PostNorm(Sublayer(Norm(x))))`` — a norm on both sides of the sublayer (Gemma 2; Ding et al.
    2021, CogView). ``post_norm`` is a second norm of the same kind, with its own weights.

    Args:
        norm: the norm before the sublayer (the one after it is a copy with its own weights).
        dropout: dropout on the sublayer's output.
    """

    def __init__(self, norm: nn.Module, dropout: float = 0.0) -> None:
        super().__init__(norm, dropout)
        self.post_norm = copy.deepcopy(norm)

    def residual(self, x: Tensor, out: Tensor) -> Tensor:
        return x + self.dropout(self.post_norm(out))
