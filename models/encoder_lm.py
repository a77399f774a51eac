"""EncoderLM — a BERT-style masked language model (Devlin et al. 2019)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks
from blocks.heads import MLMHead, check_head_options

from .checkpoints.adapter_files import AdapterFilesMixin
from .checkpoints.architectures import register_architecture
from .checkpoints.persistence import PersistenceMixin
from .core.base import ZooModel
from .core.config import TransformerConfig
from .core.outputs import ModelOutput
from .core.stack import (
    build_layers,
    build_norm,
    build_positional,
    embedding_scale,
    final_norm,
    head_logits,
    layer_positionals,
    lm_loss,
    positional_per_layer,
    positions_from_mask,
)
from .generation import EncoderLMFillMaskMixin
from .tasks import TASK_HEADS, TaskHeadMixin, document_positions
from .text_tasks import TextTasksMixin


@dataclasses.dataclass(frozen=True)
class EncoderLMConfig(TransformerConfig):
    """Config of ``EncoderLM``; defaults are BERT's choices at a tiny size.

    ``type_vocab_size`` is the number of segment (token-type) embeddings (0: none);
    ``mask_token_id`` is the ``[MASK]`` id used by ``fill_mask``. ``head`` names the registered head (``"mlm"``
    or a task head of ``models.tasks.TASK_HEADS``), its options go in ``options["head"]``. The fields every model
    shares are those of ``TransformerConfig``.

    Attributes:
        n_layers: encoder layers.
        positional: registered ``positional`` block (default ``learned``).
        ffn: registered ``ffn`` block (default ``gelu``).
        norm_eps: the norms' epsilon (BERT: 1e-12).
        type_vocab_size: segment embeddings (0: none).
        mask_token_id: the ``[MASK]`` id.
        head: registered ``head`` (``mlm`` or a task head).

    Raises:
        ValueError: a field out of range or naming no registered block (named with its value).
    """

    n_layers: int = 2
    positional: str = "learned"
    ffn: str = "gelu"
    norm_eps: float = 1e-12
    type_vocab_size: int = 2
    mask_token_id: int | None = 4
    head: str = "mlm"

    option_blocks: ClassVar[dict[str, tuple[str, str]]] = {
        **TransformerConfig.option_blocks, "head": ("head", "head"),
    }
    #: the heads an ``EncoderLM`` can take.
    heads: ClassVar[tuple[str, ...]] = ("mlm", *TASK_HEADS)

    def __post_init__(self) -> None:
        super().__post_init__()
        head_options = check_head_options(self.head, self.options.get("head", {}), self.heads, "EncoderLM")
        if "head" in self.options:
            object.__setattr__(self, "options", {**self.options, "head": head_options})
        if isinstance(self.n_layers, bool) or not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer, got {self.n_layers!r}")
        self.check_layer_options_length(self.n_layers)
        if isinstance(self.type_vocab_size, bool) or not isinstance(self.type_vocab_size, int) \
                or self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be an integer >= 0, got {self.type_vocab_size!r}")
        if self.mask_token_id is not None and (
            isinstance(self.mask_token_id, bool) or not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"mask_token_id={self.mask_token_id!r} must be None or an id in [0, vocab_size={self.vocab_size})"
            )

    def layer_builders(self) -> list[str]:
        return ["encoder"]


@register_architecture
class EncoderLM(EncoderLMFillMaskMixin, TaskHeadMixin, TextTasksMixin, PersistenceMixin, AdapterFilesMixin, ZooModel):
    """Token + position + segment embeddings → norm → post-norm encoder layers → MLM head whose decoder
    is tied to the token embedding; or, with a task head (``config.head``), that head as ``model.head``.

    Initialisation (BERT): every weight ~ N(0, 0.02), biases 0, norms 1.

    Args:
        config: the model's ``EncoderLMConfig``.

    Shapes: input_ids ``(B, L)`` -> logits ``(B, L, vocab_size)``.
    """

    config_class: ClassVar[type[TransformerConfig]] = EncoderLMConfig
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2, max_len=128, dropout=0.1),
    }

    def __init__(self, config: EncoderLMConfig) -> None:
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_scale = embedding_scale(c)
        self.positional = build_positional(c, causal=False)
        self.layer_positionals = layer_positionals(c, range(c.n_layers), causal=False)
        self.token_type_embed = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.embed_norm = build_norm(c)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = build_layers(c, "encoder", range(c.n_layers))
        self.final_norm = final_norm(c)
        if c.head == "mlm":
            self.mlm_head = MLMHead(c.d_model, c.vocab_size, lambda: build_norm(c), bias=c.bias)
        else:
            self.head = self.build_task_head()
        self.reset_parameters()
        if c.tie_embeddings and c.head == "mlm":
            self.mlm_head.decoder.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """BERT initialisation (see the class docstring)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """The encoder without the MLM head.

        Args:
            input_ids: the token ids.
            attention_mask: bool, True = real token.
            token_type_ids: segment ids (default 0).
            document_ids: several sequences packed in a row (``embed`` packs them): attention stays inside each
                document and positions restart at every document start.
            output_hidden_states: collect every layer's output.
            output_attentions: collect every layer's attention weights (the ``math`` backend computes them).

        Returns:
            ``(last hidden state, hidden states, attentions)``; the lists are empty unless asked for.

        Raises:
            ValueError: ids outside the vocabulary, a mask, segments or document ids of the wrong shape, segments
                on a model without them, or a sequence longer than ``max_len`` with learned positions.

        Shapes: input_ids ``(B, L)`` -> ``(B, L, d_model)``.
        """
        self.check_ids(input_ids, "input_ids")
        b, length = input_ids.shape
        attention_mask = self.check_mask(attention_mask, (b, length), "attention_mask")
        x = self.embed_tokens(input_ids) * self.embed_scale
        if token_type_ids is not None:
            if self.token_type_embed is None:
                raise ValueError("token_type_ids given but the model has type_vocab_size=0")
            if tuple(token_type_ids.shape) != (b, length):
                raise ValueError(
                    f"token_type_ids must have shape {(b, length)} like input_ids, got {tuple(token_type_ids.shape)}"
                )
            if token_type_ids.numel() and not 0 <= int(token_type_ids.min()) <= int(token_type_ids.max()) \
                    < self.config.type_vocab_size:
                raise ValueError(
                    f"token_type_ids must be in [0, type_vocab_size={self.config.type_vocab_size}), got "
                    f"values in [{int(token_type_ids.min())}, {int(token_type_ids.max())}]"
                )
        if self.token_type_embed is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embed(token_type_ids)
        positions, _ = positions_from_mask(attention_mask, 0, length, input_ids.device)
        if document_ids is not None:
            if tuple(document_ids.shape) != (b, length):
                raise ValueError(f"document_ids must have shape {(b, length)}, got {tuple(document_ids.shape)}")
            positions = document_positions(document_ids)
        self.positional.check_positions(positions)
        x = self.dropout(self.embed_norm(self.positional(x, positions)))  # (B, L, d_model)
        per_layer = positional_per_layer(self.positional, self.layer_positionals, len(self.layers), positions,
                                         positions)
        mask = None if attention_mask is None else blocks.padding_mask(attention_mask)  # (B, 1, 1, L)
        if document_ids is not None:
            same_document = blocks.document_mask(document_ids)  # (B, 1, L, L)
            mask = same_document if mask is None else mask & same_document
        hidden_states, attentions = [x], []
        for layer, (rotary, bias) in zip(self.layers, per_layer, strict=True):
            x, weights = layer(
                x, mask=mask, bias=bias, rotary=rotary, positions=positions, need_weights=output_attentions
            )
            hidden_states.append(x)
            attentions.append(weights)
        x = self.final_norm(x)
        hidden_states[-1] = x
        return x, hidden_states, attentions

    def final_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        """The last hidden state (what the heads read).

        Args:
            input_ids: the token ids.
            attention_mask: bool, True = real token.
            document_ids: as in ``encode``.

        Returns:
            The hidden states.

        Shapes: input_ids ``(B, L)`` -> ``(B, L, d_model)``.
        """
        return self.encode(input_ids, attention_mask, document_ids=document_ids)[0]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        masked_only: bool = False,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """Masked-LM logits for every position (or only the labelled ones); with a task head, the head's output
        (``labels`` then as the head takes them: ``(B,)`` classes or ``(B, num_labels)`` targets for
        ``sequence_classification``, ``(B, L)`` for ``token_classification``, ``(B, 2)`` start/end positions for
        ``question_answering``; see ``blocks.heads``).

        Args:
            input_ids: ``(B, L)`` token ids.
            attention_mask: ``(B, L)`` bool, True = real token.
            token_type_ids: ``(B, L)`` segment ids in ``[0, type_vocab_size)`` (default 0).
            labels: ``(B, L)`` original ids at the positions to predict, -100 elsewhere; the loss
                covers only labelled positions.
            masked_only: with ``labels``, run the MLM head only at labelled positions (about 15% of them
                in MLM training), which skips most of the vocabulary projection; ``logits`` is then
                ``(N, vocab_size)`` for the N labelled positions in row-major order.

        Returns:
            ``ModelOutput`` with ``logits (B, L, vocab_size)`` (or ``(N, vocab_size)``, see
            ``masked_only``), and ``loss`` when labels are given.

        Raises:
            ValueError: ids outside the vocabulary, masks/labels/segments of the wrong shape, or a
                sequence longer than ``max_len`` with learned positions.

        Shapes: input_ids ``(B, L)`` -> logits ``(B, L, vocab_size)`` (``(N, vocab_size)`` with ``masked_only``).
        """
        if labels is not None and not self.has_task_head and tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels must have shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        x, hidden_states, attentions = self.encode(
            input_ids, attention_mask, token_type_ids,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        if self.has_task_head:
            if masked_only:
                raise ValueError(f"masked_only=True applies to the 'mlm' head, not {self.config.head!r}")
            return self.task_output(x, attention_mask, labels, hidden_states if output_hidden_states else None,
                                    attentions if output_attentions else None)
        if masked_only:
            if labels is None:
                raise ValueError("masked_only=True needs labels (it keeps only the labelled positions)")
            selected = labels != -100
            logits = head_logits(self.config, self.mlm_head, x[selected])  # (N, vocab_size)
            loss = lm_loss(logits, labels[selected])
        else:
            logits = head_logits(self.config, self.mlm_head, x)  # (B, L, vocab_size)
            loss = None if labels is None else lm_loss(logits, labels)
        return ModelOutput(
            logits=logits,
            loss=loss,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
