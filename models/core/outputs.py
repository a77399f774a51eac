"""Model output objects."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class ModelOutput:
    """What a model's ``forward`` returns.

    Attributes:
        logits: ``(B, L, vocab_size)`` for language models, ``(B, num_labels)`` for classifiers.
        loss: scalar, when ``labels`` were given (positions labelled -100 are ignored).
        hidden_states: with ``output_hidden_states=True``: the embeddings' output then every layer's
            output, each ``(B, L, d_model)`` (the last one after the final norm, if the model has one).
        attentions: with ``output_attentions=True``: per layer, the weights ``(B, H, Lq, Lk)``.
        aux_loss: the mixture-of-experts router loss, already weighted by its coefficients (``blocks.moe``), when
            labels are given (it is then inside ``loss``) or in training mode; None without MoE blocks.
    """

    logits: Tensor
    loss: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    aux_loss: Tensor | None = None


@dataclass
class QuestionAnsweringOutput(ModelOutput):
    """``ModelOutput`` of a ``question_answering`` head: ``logits (B, L, 2)`` and their two halves.

    Attributes:
        start_logits / end_logits: ``(B, L)`` scores of each token starting / ending the answer.
    """

    start_logits: Tensor | None = None
    end_logits: Tensor | None = None


@dataclass
class Seq2SeqOutput(ModelOutput):
    """``ModelOutput`` of an encoder-decoder; ``hidden_states`` and ``attentions`` are the decoder's.

    Attributes:
        encoder_last_hidden_state: the memory ``(B, S, d_model)``.
        encoder_hidden_states / encoder_attentions: the encoder's, as for ``hidden_states``/``attentions``.
        cross_attentions: per decoder layer, ``(B, H, L, S)``.
    """

    encoder_last_hidden_state: Tensor | None = None
    encoder_hidden_states: tuple[Tensor, ...] | None = None
    encoder_attentions: tuple[Tensor, ...] | None = None
    cross_attentions: tuple[Tensor, ...] | None = None


@dataclass
class Seq2SeqQuestionAnsweringOutput(Seq2SeqOutput):
    """``Seq2SeqOutput`` of a ``question_answering`` head: ``logits (B, L, 2)`` over the decoder positions and their
    halves ``start_logits`` / ``end_logits`` ``(B, L)``.

    Attributes:
        start_logits: the start-position logits ``(B, L)``.
        end_logits: the end-position logits ``(B, L)``.
    """

    start_logits: Tensor | None = None
    end_logits: Tensor | None = None
