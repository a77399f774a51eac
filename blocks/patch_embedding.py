"""Patch embeddings: an image cut into non-overlapping patches, each projected to a token (ViT, Dosovitskiy et al.
2021, §3.1), registered under kind ``patch_embedding``."""

from __future__ import annotations

from torch import Tensor, nn

from .registry import register


class PatchEmbedding(nn.Module):
    """Base class: checks images and reports their patch grid; subclasses implement ``forward``.

    Args:
        d_model: width of each patch token.
        patch_size: side of a square patch, in pixels.
        num_channels: channels of the input images.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, d_model: int, patch_size: int, num_channels: int = 3) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("patch_size", patch_size), ("num_channels", num_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.d_model, self.patch_size, self.num_channels = d_model, patch_size, num_channels

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, patch_size={self.patch_size}, num_channels={self.num_channels}"

    def grid(self, pixel_values: Tensor) -> tuple[int, int]:
        """The patch grid ``(rows, columns)`` of a batch of images, after checking the batch.

        Args:
            pixel_values: ``(B, C, H, W)`` floating-point images.

        Returns:
            ``(H // patch_size, W // patch_size)``.

        Raises:
            ValueError: not a 4-d floating-point tensor, ``C != num_channels``, or a height or width that
                the patch size does not divide.

        Shapes: pixel_values ``(B, C, H, W)``.
        """
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4:
            got = f"shape {tuple(pixel_values.shape)}" if isinstance(pixel_values, Tensor) else type(pixel_values)
            raise ValueError(f"pixel_values must be a (B, C, H, W) tensor, got {got}")
        if not pixel_values.dtype.is_floating_point:
            raise ValueError(f"pixel_values must be floating point (normalised images), got dtype {pixel_values.dtype}")
        _, channels, height, width = pixel_values.shape
        if channels != self.num_channels:
            raise ValueError(
                f"pixel_values has {channels} channels, expected num_channels={self.num_channels} "
                f"(shape {tuple(pixel_values.shape)} read as (B, C, H, W))"
            )
        p = self.patch_size
        if height % p or width % p or height == 0 or width == 0:
            raise ValueError(f"image size {height}x{width} is not a positive multiple of patch_size={p}")
        return height // p, width // p


@register("patch_embedding", "conv")
class ConvPatchEmbedding(PatchEmbedding):
    """A convolution whose kernel and stride are the patch size: one linear projection per patch, row-major
    over the grid (equal to unfolding the patches and applying one shared linear map).

    Args:
        d_model: width of each patch token.
        patch_size: side of a square patch, in pixels.
        num_channels: channels of the input images.
        bias: whether the projection has a bias.

    Shapes: ``(B, C, H, W)`` -> ``(B, (H / patch_size) * (W / patch_size), d_model)``.
    """

    def __init__(self, d_model: int, patch_size: int, num_channels: int = 3, bias: bool = True) -> None:
        super().__init__(d_model, patch_size, num_channels)
        self.proj = nn.Conv2d(num_channels, d_model, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, pixel_values: Tensor) -> Tensor:
        self.grid(pixel_values)
        x = self.proj(pixel_values.to(self.proj.weight.dtype))  # (B, d_model, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, N, d_model), patches in row-major order
