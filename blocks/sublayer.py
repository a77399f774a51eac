"""The residual connection around each sublayer (paper §3.1, §5.4), post-norm or pre-norm."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .registry import register


class SublayerConnection(nn.Module):
    """Wraps a sublayer function with dropout, a residual connection and a normalisation.

    Args:
        norm: the normalisation module (owned by this connection, named ``norm`` in checkpoints).
        dropout: dropout applied to the sublayer output before the residual sum (§5.4).
    """

    def __init__(self, norm: nn.Module, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = norm
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        raise NotImplementedError


@register("sublayer", "post_norm")
class PostNorm(SublayerConnection):
    """``LayerNorm(x + Dropout(Sublayer(x)))`` — the paper's arrangement."""

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self.norm(x + self.dropout(sublayer(x)))


@register("sublayer", "pre_norm")
class PreNorm(SublayerConnection):
    """``x + Dropout(Sublayer(Norm(x)))`` — trains deep stacks without warm-up (Xiong et al. 2020);
    a model built from it needs a final norm after the last layer."""

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return x + self.dropout(sublayer(self.norm(x)))
