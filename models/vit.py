"""VisionTransformer — an image classifier built from the zoo's encoder blocks (ViT, Dosovitskiy et al. 2021).

An image is cut into patches, each patch projected to a token (§3.1, Eq. 1); a learned class token is
prepended and learned position embeddings added; pre-norm encoder layers with a GELU MLP (Eq. 2-3) and a
final LayerNorm (Eq. 4) follow, and a linear head reads the class token (or the mean of the patch tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks
from blocks.heads import IMAGE_POOLINGS, build_head
from blocks.patch_embedding import PatchEmbedding
from blocks.positional import LearnedPositionalEmbedding

from .checkpoints.adapter_files import AdapterFilesMixin
from .checkpoints.architectures import register_architecture
from .checkpoints.persistence import PersistenceMixin
from .core.base import ZooModel
from .core.config import ConfigBase, check_attention_shape, check_positive_int
from .core.outputs import ModelOutput
from .core.stack import (
    final_norm,
    layer_kwargs,
)

POOLINGS = IMAGE_POOLINGS
VIT_HEADS = ("image_classification",)
#: Positional encodings that make sense on a patch grid: learned absolute embeddings (interpolated to other
#: grids) or none at all. 1-d schemes (sinusoidal over the flattened grid, rotary, ALiBi) are rejected.
VIT_POSITIONALS = ("learned", "none")


@dataclasses.dataclass(frozen=True)
class VisionTransformerConfig(ConfigBase):
    """Config of ``VisionTransformer``; defaults are ViT's choices at a tiny size (32x32 images, 4x4 patches).

    Square images of side ``image_size`` are cut into ``(image_size / patch_size)^2`` patches. ``n_kv_heads``
    defaults to ``n_heads``, ``d_head`` to ``d_model // n_heads`` and ``d_value`` to ``d_head`` (filled in at
    construction, so ``to_dict`` shows the effective values).
    ``pooling`` is ``"cls"`` (the class token's final state, as in ViT) or ``"mean"`` (the mean of the
    patch tokens). ``positional`` is ``"learned"`` or ``"none"``. ``head`` names the registered head
    (``"image_classification"``, the only one); ``num_labels`` and ``pooling`` are its options.

    Attributes:
        image_size: the side of the (square) images.
        patch_size: the side of each patch.
        num_channels: image channels.
        d_model: the model's width.
        n_layers: encoder layers.
        n_heads: attention heads.
        n_kv_heads: key/value heads (default ``n_heads``).
        d_head: query/key width per head.
        d_value: value width per head.
        d_ff: the feed-forward block's inner width.
        dropout: dropout on embeddings and sublayer outputs.
        attention_dropout: dropout on the attention weights.
        norm: registered ``norm`` block.
        norm_eps: the norms' epsilon.
        ffn: registered ``ffn`` block.
        sublayer: registered ``sublayer`` block.
        attention: registered ``attention`` block.
        attention_backend: registered ``attention_backend``.
        patch_embedding: registered ``patch_embedding`` block.
        num_labels: classes of the head.
        pooling: ``"cls"`` or ``"mean"``.
        positional: ``"learned"`` or ``"none"``.

    Raises:
        ValueError: a bad value; the message quotes it.
    """

    image_size: int = 32
    patch_size: int = 4
    num_channels: int = 3
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_value: int | None = None
    d_ff: int = 256
    dropout: float = 0.0
    attention_dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-12
    ffn: str = "gelu"
    sublayer: str = "pre_norm"
    attention: str = "mha"
    attention_backend: str = "sdpa"
    patch_embedding: str = "conv"
    num_labels: int = 10
    pooling: str = "cls"
    positional: str = "learned"
    bias: bool = True
    head: str = "image_classification"

    #: the heads a ``VisionTransformer`` can take.
    heads: ClassVar[tuple[str, ...]] = VIT_HEADS

    def __post_init__(self) -> None:
        if self.head not in self.heads:
            raise ValueError(f"head {self.head!r} does not fit a VisionTransformer; expected one of {list(self.heads)}")
        for name in ("image_size", "patch_size", "num_channels", "d_model", "n_layers", "n_heads", "d_ff",
                     "num_labels"):
            check_positive_int(self, name)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}"
            )
        check_attention_shape(self)
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be a bool, got {self.bias!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not supported; expected one of {list(POOLINGS)}")
        if self.positional not in VIT_POSITIONALS:
            raise ValueError(
                f"positional={self.positional!r} is not supported by VisionTransformer; "
                f"expected one of {list(VIT_POSITIONALS)}"
            )
        for field, kind in (
            ("ffn", "ffn"),
            ("norm", "norm"),
            ("sublayer", "sublayer"),
            ("attention", "attention"),
            ("attention_backend", "attention_backend"),
            ("patch_embedding", "patch_embedding"),
        ):
            value = getattr(self, field)
            if value not in blocks.names(kind):
                raise ValueError(f"{field}={value!r} is not a registered {kind}; expected one of {blocks.names(kind)}")

    @property
    def grid_size(self) -> int:
        """Patches per side of a ``image_size`` image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Patch tokens of a ``image_size`` image (the class token not counted)."""
        return self.grid_size**2


def interpolate_position_embeddings(table: Tensor, grid: tuple[int, int], new_grid: tuple[int, int]) -> Tensor:
    """Resample learned position embeddings to another patch grid, bicubically over the grid (as ``transformers``
    and DINO do); the leading class-token row is kept as is.

    Args:
        table: ``(1 + rows * cols, D)``: the class token's row, then the patches' rows in row-major order.
        grid: ``(rows, cols)`` the table was learned for.
        new_grid: ``(rows, cols)`` wanted.

    Returns:
        ``(1 + new_rows * new_cols, D)``; ``table`` itself when the grids are equal.

    Raises:
        ValueError: the table's length does not match ``grid``.

    Shapes: ``(1 + R*C, D)`` -> ``(1 + R'*C', D)``.
    """
    rows, cols = grid
    if table.dim() != 2 or table.shape[0] != 1 + rows * cols:
        raise ValueError(f"table of shape {tuple(table.shape)} does not hold 1 + {rows}x{cols} positions")
    if tuple(new_grid) == (rows, cols):
        return table
    cls_row, patches = table[:1], table[1:]
    d = table.shape[1]
    patches = patches.reshape(1, rows, cols, d).permute(0, 3, 1, 2)  # (1, D, R, C)
    patches = nn.functional.interpolate(patches, size=tuple(new_grid), mode="bicubic", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(-1, d)  # (R' * C', D)
    return torch.cat([cls_row, patches], dim=0)


@register_architecture
class VisionTransformer(PersistenceMixin, AdapterFilesMixin, ZooModel):
    """Patch embedding + class token + learned positions → pre-norm encoder layers → final norm → linear head
    on the pooled token.

    Parameter names: ``patch_embed.proj``, ``cls_token`` ``(1, 1, d_model)``, ``positional.weight``
    ``(1 + num_patches, d_model)``, ``layers.{i}.*`` (the zoo's encoder layer), ``final_norm``, ``classifier``.

    Initialisation (ViT / ``transformers``): every weight, the class token and the position table
    ~ N(0, 0.02) truncated at ±2, biases 0, norms 1.

    Args:
        config: the model's ``VisionTransformerConfig``.

    Shapes: pixel_values ``(B, C, H, W)`` -> logits ``(B, num_labels)``.
    """

    config_class: ClassVar[type[VisionTransformerConfig]] = VisionTransformerConfig
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(image_size=32, patch_size=4, num_channels=3, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                     num_labels=10),
    }

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        c = config
        self.patch_embed: PatchEmbedding = blocks.build(
            "patch_embedding", c.patch_embedding, d_model=c.d_model, patch_size=c.patch_size,
            num_channels=c.num_channels, bias=c.bias,
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.positional = blocks.build(
            "positional", c.positional, d_model=c.d_model, n_heads=c.n_heads, d_head=c.d_head,
            max_len=1 + c.num_patches,
        )
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            blocks.build("layer", "encoder", **layer_kwargs(c)) for _ in range(c.n_layers)
        )
        # Eq. 4: the final LayerNorm.
        self.final_norm = final_norm(c)
        # The registered head (``image_classification``: a linear layer), under ViT's name for it.
        self.classifier = build_head(c.head, {"num_labels": c.num_labels, "pooling": c.pooling}, d_model=c.d_model,
                                     bias=c.bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """ViT initialisation (see the class docstring)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.trunc_normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    # ------------------------------------------------------------------ input checks
    def check_pixels(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> tuple[int, int]:
        """Check a batch of images and return its patch grid ``(rows, cols)``.

        Args:
            pixel_values: the images.
            interpolate_pos_encoding: other image sizes are allowed (the positions are resampled).

        Returns:
            ``(rows, cols)`` of patches.

        Shapes: pixel_values ``(B, num_channels, H, W)``.

        Raises:
            ValueError: not ``(B, num_channels, H, W)`` floating point, a side the patch size does not divide,
                or (with learned positions and no interpolation) a size other than ``image_size``.
        """
        grid = self.patch_embed.grid(pixel_values)
        size = self.config.image_size
        if isinstance(self.positional, LearnedPositionalEmbedding) and not interpolate_pos_encoding \
                and tuple(pixel_values.shape[-2:]) != (size, size):
            raise ValueError(
                f"image size {pixel_values.shape[-2]}x{pixel_values.shape[-1]} differs from the model's "
                f"image_size={size} ({size}x{size}); pass interpolate_pos_encoding=True to resample the "
                "position embeddings"
            )
        return grid

    def check_labels(self, labels: Tensor | None, batch: int) -> None:
        """Check that ``labels`` is None or ``(B,)`` integer classes in ``[0, num_labels)`` (or -100, ignored).

        Args:
            labels: the labels, or None.
            batch: the number of images.

        Raises:
            ValueError: another shape or dtype, or a class out of range (named).

        Shapes: labels ``(B,)``.
        """
        if labels is None:
            return
        if not isinstance(labels, Tensor) or tuple(labels.shape) != (batch,):
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"labels must have shape ({batch},) (one class per image), got {got}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"labels must hold integer class ids, got dtype {labels.dtype}")
        bad = labels[(labels != -100) & ((labels < 0) | (labels >= self.config.num_labels))]
        if bad.numel():
            raise ValueError(
                f"labels contains class {int(bad[0])}, outside [0, num_labels={self.config.num_labels}) "
                "(use -100 to ignore an image)"
            )

    # ------------------------------------------------------------------ model
    def embed(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> Tensor:
        """Patch tokens with the class token prepended and positions added (before dropout).

        Args:
            pixel_values: the images.
            interpolate_pos_encoding: resample the learned positions to the input's patch grid.

        Returns:
            The tokens.

        Shapes: ``(B, C, H, W)`` -> ``(B, 1 + (H / p) * (W / p), d_model)``.
        """
        rows, cols = self.check_pixels(pixel_values, interpolate_pos_encoding)
        x = self.patch_embed(pixel_values)  # (B, N, d_model)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, d_model)
        if isinstance(self.positional, LearnedPositionalEmbedding):
            g = self.config.grid_size
            return x + interpolate_position_embeddings(self.positional.weight, (g, g), (rows, cols))
        positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, 1 + N)
        return self.positional(x, positions)

    def encode(
        self,
        pixel_values: Tensor,
        *,
        output_attentions: bool = False,
        interpolate_pos_encoding: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """The encoder without pooling or head.

        Args:
            pixel_values: the images.
            output_attentions: collect each layer's attention weights.
            interpolate_pos_encoding: resample the learned positions to the input's patch grid.

        Shapes: pixel_values ``(B, C, H, W)`` -> ``(B, 1 + N, d_model)``.

        Returns:
            ``(last hidden state (B, 1 + N, d_model) after the final norm, hidden states, attentions)``:
            the embeddings' output then every layer's output (the last one normalised), and per layer the
            attention weights ``(B, H, 1 + N, 1 + N)`` (None unless ``output_attentions``).
        """
        x = self.dropout(self.embed(pixel_values, interpolate_pos_encoding))
        hidden_states, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, need_weights=output_attentions)  # every patch sees every patch: no mask
            hidden_states.append(x)
            attentions.append(weights)
        x = self.final_norm(x)
        hidden_states[-1] = x
        return x, hidden_states, attentions

    def pool(self, x: Tensor) -> Tensor:
        """The image representation: the class token (``pooling="cls"``) or the mean of the patch tokens.

        Args:
            x: the encoder's output.

        Returns:
            One vector per image.

        Shapes: ``(B, 1 + N, d_model)`` -> ``(B, d_model)``.
        """
        return self.classifier.pool(x)

    def forward(
        self,
        pixel_values: Tensor,
        labels: Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        interpolate_pos_encoding: bool = False,
    ) -> ModelOutput:
        """Class logits for a batch of images.

        Args:
            pixel_values: ``(B, num_channels, H, W)`` normalised images; ``H = W = image_size`` unless
                ``interpolate_pos_encoding`` (then any sides divisible by ``patch_size``).
            labels: ``(B,)`` class ids in ``[0, num_labels)``, -100 to ignore an image; gives ``.loss``
                (mean cross-entropy).
            output_hidden_states: add ``.hidden_states`` (embeddings, then each layer; the last normalised).
            output_attentions: add ``.attentions``, per layer ``(B, H, 1 + N, 1 + N)``.
            interpolate_pos_encoding: resample the learned position embeddings bicubically to the input's
                patch grid.

        Returns:
            ``ModelOutput`` with ``logits (B, num_labels)`` and ``loss`` when labels are given.

        Raises:
            ValueError: wrong rank, dtype or channel count, a side the patch size does not divide, another
                image size without ``interpolate_pos_encoding``, or bad labels — before any computation.

        Shapes: pixel_values ``(B, C, H, W)``, labels ``(B,)`` -> logits ``(B, num_labels)``.
        """
        self.check_pixels(pixel_values, interpolate_pos_encoding)
        self.check_labels(labels, pixel_values.shape[0])
        x, hidden_states, attentions = self.encode(
            pixel_values, output_attentions=output_attentions, interpolate_pos_encoding=interpolate_pos_encoding
        )
        logits = self.classifier(self.pool(x))  # (B, num_labels)
        return ModelOutput(
            logits=logits,
            loss=None if labels is None else self.classifier.loss(logits, labels),
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
