"""Seq2SeqTransformer — the encoder-decoder of *Attention Is All You Need* (Vaswani et al. 2017)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import blocks
from blocks.heads import build_head, check_head_options
from blocks.kv_cache import LayerCache

from .checkpoints.adapter_files import AdapterFilesMixin
from .checkpoints.architectures import register_architecture
from .checkpoints.persistence import PersistenceMixin
from .core.base import ZooModel
from .core.config import TransformerConfig
from .core.outputs import Seq2SeqOutput, Seq2SeqQuestionAnsweringOutput
from .core.stack import (
    build_layers,
    build_norm,
    build_positional,
    cached_length,
    embedding_scale,
    final_norm,
    head_logits,
    layer_positionals,
    lm_loss,
    positional_per_layer,
    positions_from_mask,
)
from .generation import Seq2SeqGenerationMixin
from .generation.requests import check_token_head

#: the heads a ``Seq2SeqTransformer`` can take: the LM head, and the task heads BART and T5 have (both read the
#: decoder's states: classification at the source's last EOS token, QA at every position).
SEQ2SEQ_HEADS = ("lm", "sequence_classification", "question_answering")


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig(TransformerConfig):
    """Config of ``Seq2SeqTransformer``; defaults follow the paper.

    ``layer_options`` has one entry per encoder layer, then one per decoder layer. The fields every model shares are
    those of ``TransformerConfig``.

    Attributes:
        n_encoder_layers: N of the encoder stack.
        n_decoder_layers: N of the decoder stack.
        share_embeddings: one embedding matrix for source and target (§3.4, with a shared vocabulary).
        tie_embeddings: the pre-softmax projection shares the target embedding's weights (§3.4).
        scale_embeddings: multiply embeddings by sqrt(d_model) (§3.4).
        embedding_norm: a norm after embeddings + positions (BART's ``layernorm_embedding``).
        output_bias: a bias on the output projection (Marian/BART ``final_logits_bias``).
        decoder_start_token_id: first decoder input (default ``bos_token_id``).
        head: ``"lm"`` or a task head of ``SEQ2SEQ_HEADS`` (options in ``options["head"]``): BART's and T5's
            ``ForSequenceClassification`` (pooling ``"last"``: the decoder state at the source's last EOS token)
            and ``ForQuestionAnswering`` (start/end logits over the decoder positions).

    Raises:
        ValueError: a field out of range or naming no registered block (named with its value).
    """

    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    share_embeddings: bool = True
    scale_embeddings: bool = True
    embedding_norm: bool = False
    output_bias: bool = False
    decoder_start_token_id: int | None = None
    head: str = "lm"

    option_blocks: ClassVar[dict[str, tuple[str, str]]] = {
        **TransformerConfig.option_blocks, "head": ("head", "head"),
    }
    #: the heads a ``Seq2SeqTransformer`` can take.
    heads: ClassVar[tuple[str, ...]] = SEQ2SEQ_HEADS

    def __post_init__(self) -> None:
        super().__post_init__()
        head_options = check_head_options(self.head, self.options.get("head", {}), self.heads, "Seq2SeqTransformer")
        if "head" in self.options:
            object.__setattr__(self, "options", {**self.options, "head": head_options})
        pooling = head_options.get("pooling", "last")
        if self.head == "sequence_classification" and pooling != "last":
            raise ValueError(f"a Seq2SeqTransformer classifies from the decoder state at the source's last EOS "
                             f"token (pooling 'last'), got pooling {pooling!r}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.check_layer_options_length(self.n_encoder_layers + self.n_decoder_layers)
        if self.decoder_start_token_id is None:
            object.__setattr__(self, "decoder_start_token_id", self.bos_token_id)
        start = self.decoder_start_token_id
        if start is not None and not 0 <= start < self.vocab_size:
            raise ValueError(f"decoder_start_token_id={start!r} must be an id in [0, vocab_size={self.vocab_size})")


def _paper(d_model: int, d_ff: int, n_heads: int, dropout: float) -> dict[str, Any]:
    return dict(
        vocab_size=37000, d_model=d_model, d_ff=d_ff, n_heads=n_heads, n_encoder_layers=6, n_decoder_layers=6,
        dropout=dropout, max_len=1024, positional="sinusoidal", ffn="relu", sublayer="post_norm",
    )


@register_architecture
class Seq2SeqTransformer(Seq2SeqGenerationMixin, PersistenceMixin, AdapterFilesMixin, ZooModel):
    """The paper's encoder-decoder (Figure 1): post-norm sublayers, sinusoidal encodings, embeddings
    scaled by sqrt(d_model) with dropout on the sum of embeddings and encodings (§5.4), and one weight
    matrix shared by the source embedding, target embedding and pre-softmax projection.

    Initialisation: Xavier-uniform for every weight matrix (as the paper's reference implementation
    tensor2tensor), embeddings ~ N(0, d_model^-1/2) so that scaled embeddings have unit variance,
    biases 0.

    Args:
        config: the model's ``Seq2SeqConfig``.

    Shapes: src_ids ``(B, S)``, tgt_ids ``(B, L)`` -> logits ``(B, L, vocab_size)``.
    """

    config_class: ClassVar[type[TransformerConfig]] = Seq2SeqConfig
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(
            vocab_size=1000, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2,
            dropout=0.1, max_len=256,
        ),
        # Table 3: base and big.
        "base": _paper(d_model=512, d_ff=2048, n_heads=8, dropout=0.1),
        "big": _paper(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3),
    }

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        c = config
        self.src_embed = nn.Embedding(c.vocab_size, c.d_model)
        self.tgt_embed = self.src_embed if c.share_embeddings else nn.Embedding(c.vocab_size, c.d_model)
        encoder_indices = range(c.n_encoder_layers)
        decoder_indices = range(c.n_encoder_layers, c.n_encoder_layers + c.n_decoder_layers)
        self.encoder_positional = build_positional(c, causal=False)
        self.decoder_positional = build_positional(c, causal=True)
        self.encoder_layer_positionals = layer_positionals(c, encoder_indices, causal=False)
        self.decoder_layer_positionals = layer_positionals(c, decoder_indices, causal=True)
        self.embed_scale = embedding_scale(c)  # §3.4
        self.encoder_embed_norm = build_norm(c) if c.embedding_norm else nn.Identity()
        self.decoder_embed_norm = build_norm(c) if c.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_layers = build_layers(c, "encoder", encoder_indices)
        self.decoder_layers = build_layers(c, "decoder", decoder_indices, cross_attention=True)
        self.encoder_final_norm = final_norm(c)
        self.decoder_final_norm = final_norm(c)
        if c.head == "lm":
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.output_bias)
        else:
            options = {"pooling": "last", **c.block_options("head")} if c.head == "sequence_classification" \
                else c.block_options("head")
            # BART's and T5's classification heads have a dense bias whatever the model's (T5 has no other biases).
            self.head = build_head(c.head, options, d_model=c.d_model, make_norm=lambda: build_norm(c), bias=True,
                                   dropout=c.dropout)
        self.reset_parameters()
        if c.tie_embeddings and c.head == "lm":
            self.lm_head.weight = self.tgt_embed.weight

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, N(0, d_model^-1/2) embeddings, zero biases (see the class docstring)."""
        embeddings = {id(self.src_embed.weight), id(self.tgt_embed.weight)}
        for name, p in self.named_parameters():
            if id(p) in embeddings:
                nn.init.normal_(p, std=self.config.d_model**-0.5)
            elif p.dim() >= 2:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    # ------------------------------------------------------------------ encoder
    def _encode(
        self, src_ids: Tensor, src_mask: Tensor | None, output_hidden_states: bool, output_attentions: bool
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        self.check_ids(src_ids, "src_ids")
        b, length = src_ids.shape
        src_mask = self.check_mask(src_mask, (b, length), "src_mask")
        positions, _ = positions_from_mask(src_mask, 0, length, src_ids.device)
        pos = self.encoder_positional
        pos.check_positions(positions)
        x = self.src_embed(src_ids) * self.embed_scale
        x = self.dropout(self.encoder_embed_norm(pos(x, positions)))  # (B, S, d_model)
        per_layer = positional_per_layer(pos, self.encoder_layer_positionals, len(self.encoder_layers), positions,
                                         positions)
        mask = None if src_mask is None else blocks.padding_mask(src_mask)  # (B, 1, 1, S)
        hidden_states, attentions = [x], []
        for layer, (rotary, bias) in zip(self.encoder_layers, per_layer, strict=True):
            x, weights = layer(x, mask=mask, bias=bias, rotary=rotary, positions=positions,
                               need_weights=output_attentions)
            hidden_states.append(x)
            attentions.append(weights)
        x = self.encoder_final_norm(x)
        hidden_states[-1] = x
        return x, hidden_states, attentions

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Run the encoder.

        Args:
            src_ids: ``(B, S)`` source ids.
            src_mask: ``(B, S)`` bool, True = real token.

        Returns:
            The memory ``(B, S, d_model)``.

        Shapes: src_ids ``(B, S)`` -> ``(B, S, d_model)``.
        """
        return self._encode(src_ids, src_mask, False, False)[0]

    # ------------------------------------------------------------------ decoder
    def _decode(
        self,
        memory: Tensor,
        tgt_ids: Tensor,
        src_mask: Tensor | None,
        tgt_mask: Tensor | None,
        cache: list[LayerCache] | None,
        output_hidden_states: bool,
        output_attentions: bool,
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None], list[Tensor | None]]:
        self.check_ids(tgt_ids, "tgt_ids")
        b, length = tgt_ids.shape
        if memory.dim() != 3 or memory.shape[0] != b or memory.shape[2] != self.config.d_model:
            raise ValueError(
                f"memory must be (B={b}, S, d_model={self.config.d_model}), got {tuple(memory.shape)}"
            )
        src_mask = self.check_mask(src_mask, (b, memory.shape[1]), "src_mask")
        past = cached_length(cache)
        tgt_mask = self.check_mask(tgt_mask, (b, past + length), "tgt_mask")
        if cache is not None and len(cache) != len(self.decoder_layers):
            raise ValueError(f"cache has {len(cache)} layers, the decoder has {len(self.decoder_layers)}")
        positions, key_positions = positions_from_mask(tgt_mask, past, length, tgt_ids.device)
        pos = self.decoder_positional
        pos.check_positions(positions)
        x = self.tgt_embed(tgt_ids) * self.embed_scale
        x = self.dropout(self.decoder_embed_norm(pos(x, positions)))  # (B, L, d_model)
        per_layer = positional_per_layer(pos, self.decoder_layer_positionals, len(self.decoder_layers), positions,
                                         key_positions)
        self_mask = None if tgt_mask is None else blocks.padding_mask(tgt_mask)  # (B, 1, 1, past + L)
        memory_mask = None if src_mask is None else blocks.padding_mask(src_mask)  # (B, 1, 1, S)
        hidden_states, self_attns, cross_attns = [x], [], []
        for i, layer in enumerate(self.decoder_layers):
            rotary, bias = per_layer[i]
            x, self_w, cross_w = layer(
                x, memory, mask=self_mask, memory_mask=memory_mask, bias=bias, rotary=rotary, positions=positions,
                key_positions=key_positions, cache=None if cache is None else cache[i], need_weights=output_attentions,
            )
            hidden_states.append(x)
            self_attns.append(self_w)
            cross_attns.append(cross_w)
        x = self.decoder_final_norm(x)
        hidden_states[-1] = x
        return x, hidden_states, self_attns, cross_attns

    def decode(
        self,
        memory: Tensor,
        tgt_ids: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        *,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        """Run the decoder over ``memory`` and return next-token logits.

        Args:
            memory: encoder output ``(B, S, d_model)``.
            tgt_ids: ``(B, L)`` decoder input ids (starting with the decoder start token).
            src_mask: ``(B, S)`` bool source padding mask.
            tgt_mask: ``(B, L)`` bool target padding mask (``(B, past + L)`` with a cache).
            cache: per-layer caches (``models.core.stack.new_caches(..., cross=True)``) for incremental decoding.

        Returns:
            Logits ``(B, L, vocab_size)``.

        Shapes: memory ``(B, S, d_model)``, tgt_ids ``(B, L)`` -> ``(B, L, vocab_size)``.
        """
        check_token_head(self, "decode")
        x = self._decode(memory, tgt_ids, src_mask, tgt_mask, cache, False, False)[0]
        return head_logits(self.config, self.lm_head, x)

    def forward(
        self,
        src_ids: Tensor,
        tgt_ids: Tensor | None = None,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> Seq2SeqOutput:
        """Teacher-forced forward pass.

        Args:
            src_ids: ``(B, S)`` source ids; ``src_mask`` ``(B, S)`` bool, True = real token.
            tgt_ids: ``(B, L)`` decoder inputs (targets shifted right); ``tgt_mask`` ``(B, L)``.
            labels: ``(B, L)`` the token each position must predict (aligned with ``tgt_ids``, no
                shift inside); -100 is ignored. With a task head, as the head takes them (``(B,)`` classes or
                ``(B, num_labels)`` targets; ``(B, 2)`` start/end positions; see ``blocks.heads``).

        With a task head ``tgt_ids`` may be left out: it is then ``src_ids`` shifted right behind
        ``decoder_start_token_id``, as BART and T5 build it. ``sequence_classification`` reads the decoder state at
        the last ``eos_token_id`` of each source row; ``question_answering`` scores every decoder position.

        Returns:
            ``Seq2SeqOutput`` with ``logits (B, L, vocab_size)`` (a task head's: ``(B, num_labels)`` or
            ``(B, L, 2)``, with ``start_logits``/``end_logits``) and ``loss`` when labels are given.

        Raises:
            ValueError: ids outside the vocabulary, masks or labels of the wrong shape, sequences
                longer than ``max_len`` with learned positions; no ``tgt_ids`` for the LM head; a source row
                without ``eos_token_id`` for the classification head.

        Shapes: src_ids ``(B, S)``, tgt_ids ``(B, L)`` -> logits ``(B, L, vocab_size)``.
        """
        task = self.config.head != "lm"
        if tgt_ids is None:
            if not task:
                raise ValueError("tgt_ids is None: the 'lm' head needs the decoder inputs (targets shifted right)")
            tgt_ids = self.shift_right(src_ids)
        if labels is not None and not task and tuple(labels.shape) != tuple(tgt_ids.shape):
            raise ValueError(f"labels must have shape {tuple(tgt_ids.shape)} like tgt_ids, got {tuple(labels.shape)}")
        eos = self.eos_mask(src_ids, tgt_ids) if self.config.head == "sequence_classification" else None
        memory, enc_hidden, enc_attn = self._encode(src_ids, src_mask, output_hidden_states, output_attentions)
        x, dec_hidden, self_attn, cross_attn = self._decode(
            memory, tgt_ids, src_mask, tgt_mask, None, output_hidden_states, output_attentions
        )
        extra: dict[str, Any] = {}
        if task:
            logits = self.head(x, eos if eos is not None else tgt_mask)  # (B, num_labels) or (B, L, 2)
            loss = None if labels is None else self.head.loss(logits, labels)
            if self.config.head == "question_answering":
                extra = dict(start_logits=logits[..., 0].contiguous(), end_logits=logits[..., 1].contiguous())
        else:
            logits = head_logits(self.config, self.lm_head, x)  # (B, L, vocab_size)
            loss = None if labels is None else lm_loss(logits, labels)
        return (Seq2SeqQuestionAnsweringOutput if extra else Seq2SeqOutput)(
            **extra,
            logits=logits,
            loss=loss,
            hidden_states=tuple(dec_hidden) if output_hidden_states else None,
            attentions=tuple(self_attn) if output_attentions else None,
            encoder_last_hidden_state=memory,
            encoder_hidden_states=tuple(enc_hidden) if output_hidden_states else None,
            encoder_attentions=tuple(enc_attn) if output_attentions else None,
            cross_attentions=tuple(cross_attn) if output_attentions else None,
        )

    # ------------------------------------------------------------------ task heads
    def shift_right(self, src_ids: Tensor) -> Tensor:
        """The decoder inputs BART and T5 build from the source when none are given: ``decoder_start_token_id``
        then ``src_ids[:, :-1]``.

        Args:
            src_ids: the source ids.

        Returns:
            The decoder inputs.

        Shapes: ``(B, S)`` -> ``(B, S)``.

        Raises:
            ValueError: the config has no ``decoder_start_token_id``.
        """
        start = self.config.decoder_start_token_id
        if start is None:
            raise ValueError("tgt_ids is None and the config has no decoder_start_token_id to shift the source behind")
        self.check_ids(src_ids, "src_ids")
        shifted = torch.full_like(src_ids, start)  # (B, S)
        shifted[:, 1:] = src_ids[:, :-1]
        return shifted

    def eos_mask(self, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
        """Where the source holds ``eos_token_id`` ``(B, S)`` bool: the classification head pools the decoder
        state at each row's last one (BART's and T5's ``ForSequenceClassification``).

        Args:
            src_ids: the source ids.
            tgt_ids: the decoder inputs (of the source's shape).

        Returns:
            The bool mask.

        Shapes: src_ids, tgt_ids ``(B, S)`` -> ``(B, S)``.

        Raises:
            ValueError: no ``eos_token_id``, decoder inputs of another length than the source, or a row without EOS.
        """
        eos = self.config.eos_token_id
        if eos is None:
            raise ValueError("sequence classification pools at the source's last EOS token, but eos_token_id is None")
        if tuple(tgt_ids.shape) != tuple(src_ids.shape):
            raise ValueError(f"tgt_ids must have the shape of src_ids {tuple(src_ids.shape)} for sequence "
                             f"classification (the state at the source's EOS is read), got {tuple(tgt_ids.shape)}")
        mask = src_ids == eos  # (B, S)
        if not torch.compiler.is_compiling() and not bool(mask.any(-1).all()):
            rows = (~mask.any(-1)).nonzero().flatten().tolist()
            raise ValueError(f"src_ids rows {rows} contain no eos_token_id={eos}; sequence classification reads the "
                             "decoder state at each row's last EOS token")
        return mask
