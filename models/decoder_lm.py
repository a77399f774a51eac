"""DecoderLM — a GPT-style causal language model (Radford et al. 2018, 2019)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks
from blocks.heads import check_head_options
from blocks.kv_cache import LayerCache
from blocks.moe import router_loss

from .checkpoints.adapter_files import AdapterFilesMixin
from .checkpoints.architectures import register_architecture
from .checkpoints.persistence import PersistenceMixin
from .core.base import ZooModel
from .core.config import TransformerConfig
from .core.outputs import ModelOutput
from .core.stack import (
    build_layers,
    build_positional,
    cached_length,
    embedding_scale,
    final_norm,
    head_logits,
    layer_call,
    layer_positionals,
    lm_loss,
    positional_per_layer,
    positions_from_mask,
)
from .generation import DecoderLMGenerationMixin
from .tasks import TASK_HEADS, TaskHeadMixin
from .text_tasks import TextTasksMixin


@dataclasses.dataclass(frozen=True)
class DecoderLMConfig(TransformerConfig):
    """Config of ``DecoderLM``; defaults are GPT-2's choices at a tiny size.

    ``layer`` names the registered layer builder: ``"decoder"`` (sequential residuals) or ``"parallel"``
    (GPT-NeoX's attention and FFN side by side). ``head`` names the registered head (``"lm"`` or a task head of
    ``models.tasks.TASK_HEADS``), its options go in ``options["head"]``. The fields every model shares are those
    of ``TransformerConfig``.

    Attributes:
        n_layers: decoder layers.
        positional: registered ``positional`` block (default ``learned``).
        ffn: registered ``ffn`` block (default ``gelu_tanh``).
        sublayer: registered ``sublayer`` (default ``pre_norm``).
        layer: registered ``layer`` builder (``decoder`` or ``parallel``).
        head: registered ``head`` (``lm`` or a task head).

    Raises:
        ValueError: a field out of range or naming no registered block (named with its value).
    """

    n_layers: int = 2
    positional: str = "learned"
    ffn: str = "gelu_tanh"
    sublayer: str = "pre_norm"
    layer: str = "decoder"
    head: str = "lm"

    option_blocks: ClassVar[dict[str, tuple[str, str]]] = {
        **TransformerConfig.option_blocks, "head": ("head", "head"),
    }
    #: the heads a ``DecoderLM`` can take.
    heads: ClassVar[tuple[str, ...]] = ("lm", *TASK_HEADS)

    def __post_init__(self) -> None:
        if isinstance(self.n_layers, bool) or not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer, got {self.n_layers!r}")
        decoder_layers = [n for n in blocks.names("layer") if n != "encoder"]
        if self.layer not in decoder_layers:
            raise ValueError(
                f"layer={self.layer!r} is not a registered decoder layer; expected one of {decoder_layers}"
            )
        super().__post_init__()
        self.check_layer_options_length(self.n_layers)
        head_options = check_head_options(self.head, self.options.get("head", {}), self.heads, "DecoderLM")
        if "head" in self.options:
            object.__setattr__(self, "options", {**self.options, "head": head_options})

    def layer_builders(self) -> list[str]:
        return [self.layer]


@register_architecture
class DecoderLM(DecoderLMGenerationMixin, TaskHeadMixin, TextTasksMixin, PersistenceMixin, AdapterFilesMixin, ZooModel):
    """Token embedding + positions → pre-norm decoder blocks (no cross-attention) → final norm →
    output projection tied to the token embedding.

    Initialisation (GPT-2): every weight ~ N(0, 0.02), biases 0, and the projections that write into
    the residual stream (``o_proj``, ``down_proj``) ~ N(0, 0.02 / sqrt(2 · n_layers)).

    With a task head (``config.head``) the output projection is replaced by that head (``model.head``); sequence
    classification reads the last real token (``pooling="last"``), as ``transformers``' decoders do.

    Args:
        config: the model's ``DecoderLMConfig``.

    Shapes: input_ids ``(B, L)`` -> logits ``(B, L, vocab_size)``.
    """

    default_pooling = classification_pooling = "last"

    config_class: ClassVar[type[TransformerConfig]] = DecoderLMConfig
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2, max_len=256, dropout=0.1),
    }

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_scale = embedding_scale(c)
        self.positional = build_positional(c, causal=True)
        self.layer_positionals = layer_positionals(c, range(c.n_layers), causal=True)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = build_layers(c, c.layer, range(c.n_layers), cross_attention=False)
        # GPT-2 ln_f (pre-norm stacks end with a norm).
        self.final_norm = final_norm(c)
        if c.head == "lm":
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        else:
            self.head = self.build_task_head()
        self.reset_parameters()
        if c.tie_embeddings and c.head == "lm":
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (see the class docstring)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def pooling_mask(self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any) -> Tensor | None:
        """The real tokens a task head reads: the attention mask, else (as ``transformers``) the tokens that are not
        ``pad_token_id``; None (every token) for a single row without either.

        Args:
            input_ids: the token ids.
            attention_mask: the padding mask, or None.
            cache: must be None.

        Returns:
            The mask of real tokens, or None.

        Shapes: input_ids ``(B, L)``, attention_mask ``(B, L)`` -> ``(B, L)`` bool.

        Raises:
            ValueError: a cache (task heads read whole sequences), or a batch of several rows without an attention
                mask on a model without ``pad_token_id`` (the last real token of each row is unknown).
        """
        if cache is not None:
            raise ValueError(f"the {self.config.head!r} head reads whole sequences; call it without a cache")
        if attention_mask is not None:
            return attention_mask
        if self.config.pad_token_id is not None:
            return input_ids != self.config.pad_token_id
        if input_ids.shape[0] > 1:
            raise ValueError(
                "a batch of several rows needs an attention_mask or a config pad_token_id to find each row's last "
                f"token; got {input_ids.shape[0]} rows, no attention_mask and pad_token_id=None"
            )
        return None

    def final_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        """The last hidden state after the final norm (what the heads read).

        Args:
            input_ids: the token ids.
            attention_mask: the padding mask, or None.
            document_ids: packed documents' ids, or None (see ``forward``).

        Returns:
            The hidden states.

        Shapes: input_ids ``(B, L)`` -> ``(B, L, d_model)``.
        """
        out = self.forward(input_ids, attention_mask, document_ids=document_ids, output_hidden_states=True,
                           logits_to_keep=0 if self.has_task_head else 1)
        return out.hidden_states[-1]

    def save_gguf(self, path: Any, dtype: str = "F32", **options: Any) -> Any:
        """Write this model (and ``self.tokenizer``) as a GGUF file llama.cpp runs; see ``models.gguf.export``.

        Args:
            path: the file to write (atomically).
            dtype: the float tensors' type: ``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``,
                ``Q5_1`` (layers already in a GGUF block format are written as they are).
            **options: further options of ``models.gguf.export.save_gguf``.

        Returns:
            What ``save_gguf`` returns (the file's path).
        """
        from .gguf.export import save_gguf

        return save_gguf(self, path, dtype, **options)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        cache: list[LayerCache] | None = None,
        positions: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """Next-token logits.

        Args:
            input_ids: ``(B, L)`` token ids.
            attention_mask: ``(B, L)`` bool, True = real token (``(B, past + L)`` with a ``cache``).
                Positions count real tokens only, so left padding is invisible to the model.
            labels: ``(B, L)`` ids; the loss predicts ``labels[:, t + 1]`` from position ``t``
                (the shift happens inside, as in ``transformers``); -100 is ignored.
            document_ids: ``(B, L)`` ids of the packed document each token belongs to (as
                ``training.CausalLMCollator(document_ids=True)`` returns): attention stays inside each
                document and positions restart at every document start. Not with a ``cache``.
            cache: per-layer KV caches for incremental decoding (see ``models.core.stack.new_caches``).
            positions: ``(B, L)`` long positions of the tokens, instead of counting them from the mask: a
                packed batch over a paged cache (``blocks.paged_cache``) holds several sequences in one row.
            logits_to_keep: if > 0, project only the last ``logits_to_keep`` positions to the vocabulary
                (a prompt's prefill needs only the last one); 0 keeps all; a 1-D long tensor keeps those
                positions (each packed sequence's last one).

        Returns:
            ``ModelOutput`` with ``logits (B, L, vocab_size)`` and ``loss`` when labels are given.

        Raises:
            ValueError: ids outside the vocabulary, a mask or labels of the wrong shape, or a sequence
                longer than ``max_len`` with learned positions.

        Shapes: input_ids ``(B, L)``, attention_mask ``(B, past + L)`` -> logits ``(B, L, vocab_size)``.
        """
        self.check_ids(input_ids, "input_ids")
        b, length = input_ids.shape
        past = cached_length(cache)
        attention_mask = self.check_mask(attention_mask, (b, past + length), "attention_mask")
        if labels is not None and not self.has_task_head and tuple(labels.shape) != (b, length):
            raise ValueError(f"labels must have shape {(b, length)} like input_ids, got {tuple(labels.shape)}")
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the model has {len(self.layers)}")

        if document_ids is not None:
            if cache is not None:
                raise ValueError("document_ids cannot be combined with a cache")
            if tuple(document_ids.shape) != (b, length):
                raise ValueError(f"document_ids must have shape {(b, length)}, got {tuple(document_ids.shape)}")
        if positions is None:
            positions, key_positions = positions_from_mask(attention_mask, past, length, input_ids.device)
        elif tuple(positions.shape) != (b, length) or positions.dtype != torch.long:
            raise ValueError(f"positions must be a {(b, length)} long tensor, got {tuple(positions.shape)} "
                             f"{positions.dtype}")
        else:
            key_positions = positions  # a paged cache finds each packed sequence's keys itself
        if document_ids is not None:
            # Packed documents: every document starts again at position 0.
            index = torch.arange(length, device=input_ids.device).expand(b, length)
            starts = torch.ones_like(document_ids, dtype=torch.bool)
            starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
            positions = key_positions = index - torch.where(starts, index, 0).cummax(-1).values
        self.positional.check_positions(positions)
        x = self.embed_tokens(input_ids) * self.embed_scale
        x = self.dropout(self.positional(x, positions))  # (B, L, d_model)
        per_layer = positional_per_layer(self.positional, self.layer_positionals, len(self.layers), positions,
                                         key_positions)
        mask = None if attention_mask is None else blocks.padding_mask(attention_mask)  # (B, 1, 1, past + L)
        if document_ids is not None:
            same_document = blocks.document_mask(document_ids)  # (B, 1, L, L); the layers add the causal mask
            mask = same_document if mask is None else mask & same_document
        hidden_states, attentions = [x], []
        for i, layer in enumerate(self.layers):
            rotary, bias = per_layer[i]
            x, weights, _ = layer_call(layer)(
                x, mask=mask, bias=bias, rotary=rotary, positions=positions, key_positions=key_positions,
                cache=None if cache is None else cache[i], need_weights=output_attentions,
            )
            hidden_states.append(x)
            attentions.append(weights)
        # Mixture-of-experts blocks' load-balancing and z losses (None without them); see blocks.moe.
        aux_loss = router_loss((layer.ffn for layer in self.layers), attention_mask,
                               compute=labels is not None or self.training)
        x = self.final_norm(x)
        hidden_states[-1] = x
        if self.has_task_head:
            return self.task_output(x, self.pooling_mask(input_ids, attention_mask, cache), labels,
                                    hidden_states if output_hidden_states else None,
                                    attentions if output_attentions else None)
        if isinstance(logits_to_keep, Tensor):
            if labels is not None:
                raise ValueError("logits_to_keep cannot be combined with labels (the loss needs every position)")
            x, logits_to_keep = x[:, logits_to_keep], 0  # (B, L', d_model)
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        if logits_to_keep and labels is not None:
            raise ValueError("logits_to_keep cannot be combined with labels (the loss needs every position)")
        logits = head_logits(self.config, self.lm_head, x[:, -logits_to_keep:] if logits_to_keep else x)  # (B, L', V)

        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing logits[:, :-1] would copy the largest tensor.
            shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], dim=1)
            loss = lm_loss(logits, shifted)
            if aux_loss is not None:
                loss = loss + aux_loss
        return ModelOutput(
            logits=logits,
            loss=loss,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            aux_loss=aux_loss,
        )
