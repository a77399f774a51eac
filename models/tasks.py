"""Task heads on the model classes: building the configured head, its forward and loss, and ``embed``.

``TaskHeadMixin`` is mixed into ``EncoderLM`` and ``DecoderLM``. A model whose config names a task head
(``head="sequence_classification"``, ``"token_classification"``, ``"question_answering"``, ``"embedding"``; see
``blocks.heads``) holds it as ``model.head`` and its forward returns the head's logits (and loss) instead of token
logits. ``embed`` turns texts (or token ids) into sentence vectors with any head: batched by length, original order
restored.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from blocks.heads import LM_HEADS, build_head

from .checkpoints.sentence_folder import save_sentence_transformers
from .core.outputs import ModelOutput, QuestionAnsweringOutput
from .core.stack import build_norm

#: the task heads every text model (``EncoderLM``, ``DecoderLM``) can take.
TASK_HEADS = ("sequence_classification", "token_classification", "question_answering", "embedding")
#: inputs above this many texts get a progress bar when ``progress`` is None and stderr is a terminal.
PROGRESS_THRESHOLD = 256


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions that restart at 0 at every document start of packed rows.

    Args:
        document_ids: each token's document.

    Returns:
        The positions, long.

    Shapes: ``(B, L)`` -> ``(B, L)``.
    """
    b, length = document_ids.shape
    index = torch.arange(length, device=document_ids.device).expand(b, length)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def packed_batches(lengths: list[int], batch_size: int) -> list[list[list[int]]]:
    """The forward passes of ``embed``: rows of texts packed up to the longest text, about ``batch_size`` texts per
    pass.

    Each row takes the longest text left, then the shortest ones while they fit in the longest text's length, so
    rows are nearly full and little padding is computed; a pass takes rows until it holds ``batch_size`` texts.

    Args:
        lengths: each text's length in tokens.
        batch_size: texts per pass (about).

    Returns:
        Per pass, rows of text indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    width = lengths[order[0]] if order else 0
    rows, low, high = [], 0, len(order) - 1
    while low <= high:
        row, used = [order[low]], lengths[order[low]]
        low += 1
        while low <= high and used + lengths[order[high]] <= width:
            row.append(order[high])
            used += lengths[order[high]]
            high -= 1
        rows.append(row)
    passes: list[list[list[int]]] = []
    count = batch_size
    for row in rows:
        if count >= batch_size:
            passes.append([])
            count = 0
        passes[-1].append(row)
        count += len(row)
    return passes


def pool_documents(hidden: Tensor, documents: Tensor, count: int, pooling: str) -> Tensor:
    """Pool the tokens of each packed document: ``hidden (R, W, D)``, ``documents (R, W)`` ids in ``[0, count)``
    (-1 for padding) -> ``(count, D)``, as ``blocks.heads.pool`` computes each alone.

    Args:
        hidden: the packed rows' hidden states.
        documents: each token's document id.
        count: the number of documents.
        pooling: ``cls``, ``mean``, ``max``, ``last`` or ``mean_sqrt_len``.

    Returns:
        One vector per document.

    Raises:
        ValueError: an unknown pooling.

    Shapes: hidden ``(R, W, D)``, documents ``(R, W)`` -> ``(count, D)``.
    """
    flat, ids = hidden.reshape(-1, hidden.shape[-1]), documents.reshape(-1)
    real = ids >= 0
    flat, ids = flat[real], ids[real]  # (T, D), (T,)
    position = torch.arange(len(ids), device=ids.device)
    if pooling in ("cls", "last"):
        reduce = "amin" if pooling == "cls" else "amax"
        pick = torch.full((count,), -1, dtype=torch.long, device=ids.device).scatter_reduce(
            0, ids, position, reduce=reduce, include_self=False)
        return flat[pick]
    if pooling == "max":
        return flat.new_full((count, flat.shape[-1]), torch.finfo(flat.dtype).min).scatter_reduce(
            0, ids[:, None].expand_as(flat), flat, reduce="amax", include_self=False)
    total = flat.new_zeros(count, flat.shape[-1]).index_add_(0, ids, flat)
    tokens = flat.new_zeros(count).index_add_(0, ids, torch.ones_like(ids, dtype=flat.dtype))[:, None]
    if pooling not in ("mean", "mean_sqrt_len"):
        raise ValueError(f"unknown pooling {pooling!r}")
    return total / (tokens if pooling == "mean" else tokens.sqrt())


class TaskHeadMixin:
    """The task-head half of a text model (see the module docstring)."""

    #: the pooling ``embed`` uses when the model has no ``embedding`` head.
    default_pooling = "mean"
    #: the pooling of a ``sequence_classification`` head whose options name none.
    classification_pooling = "cls"

    def build_task_head(self) -> nn.Module:
        """The configured task head (``config.head`` with ``config.options["head"]``).

        Returns:
            The head module.
        """
        c = self.config
        options = c.block_options("head")
        if c.head == "sequence_classification":
            options.setdefault("pooling", self.classification_pooling)
        return build_head(
            c.head, options, d_model=c.d_model, vocab_size=c.vocab_size,
            make_norm=lambda: build_norm(c), bias=c.bias, dropout=c.dropout,
        )

    @property
    def has_task_head(self) -> bool:
        """True when the config names a task head rather than a token-predicting one."""
        return self.config.head not in LM_HEADS

    def task_output(
        self, x: Tensor, mask: Tensor | None, labels: Tensor | None, hidden_states: list[Tensor] | None,
        attentions: list[Tensor | None] | None,
    ) -> ModelOutput:
        """The head's logits (and loss) from the final hidden states.

        Args:
            x: the final hidden states.
            mask: the real tokens the head reads, or None.
            labels: the head's labels, or None.
            hidden_states: every layer's output (returned), or None.
            attentions: every layer's attention weights (returned), or None.

        Returns:
            The output (``QuestionAnsweringOutput`` for the QA head).

        Shapes: x ``(B, L, d_model)``, mask ``(B, L)`` -> logits ``(B, num_labels)``, ``(B, L, num_labels)``,
        ``(B, L, 2)`` or ``(B, d_model)`` by head.

        Raises:
            ValueError: labels for the embedding head, or labels the head's loss refuses.
        """
        logits = self.head(x, mask)
        loss = None
        if labels is not None:
            if self.config.head == "embedding":
                raise ValueError("the 'embedding' head takes no labels; pass labels=None")
            loss = self.head.loss(logits, labels)
        common = dict(
            logits=logits, loss=loss, hidden_states=None if hidden_states is None else tuple(hidden_states),
            attentions=None if attentions is None else tuple(attentions),
        )
        if self.config.head == "question_answering":
            return QuestionAnsweringOutput(
                **common, start_logits=logits[..., 0].contiguous(), end_logits=logits[..., 1].contiguous()
            )
        return ModelOutput(**common)

    # ------------------------------------------------------------------ sentence embeddings
    def save_sentence_transformers(self, directory: Any) -> Any:
        """Write the model and its tokenizer as a sentence-transformers folder (see
        ``models.checkpoints.sentence_folder.save_sentence_transformers``).

        Args:
            directory: the folder to write (``SentenceTransformer(directory)`` loads it).

        Returns:
            The folder's path.
        """
        return save_sentence_transformers(self, directory)

    def embedding_options(self) -> dict[str, Any]:
        """The embedding head's options (pooling, normalize, max_seq_length, prompts), or the defaults.

        Returns:
            The options.
        """
        if self.config.head == "embedding":
            return self.config.block_options("head")
        return {"pooling": self.default_pooling}

    @torch.no_grad()
    def embed(
        self,
        texts_or_ids: str | Sequence[str] | Sequence[Sequence[int]] | Tensor,
        batch_size: int = 32,
        normalize: bool | None = None,
        prompt: str | None = None,
        progress: bool | None = None,
    ) -> Tensor:
        """Sentence embeddings ``(N, d_model)`` (float32, on the model's device).

        Texts are tokenized with ``model.tokenizer``, truncated at the model's maximum sequence length
        (``max_seq_length`` of the embedding head, else ``max_len``), packed several to a row (attention stays inside
        each text, positions restart) so that little padding is computed, and returned in their original order.
        Pooling and normalisation are the embedding head's (``mean`` and none without one; ``last`` for decoders).

        Args:
            texts_or_ids: one text, a list of texts, a list of token-id lists or a ``(N, L)`` id tensor.
            batch_size: rows per forward pass.
            normalize: L2-normalise the vectors (default: the head's ``normalize``).
            prompt: a prompt name of the head's ``prompts`` or a literal string, prepended to every text.
            progress: show a tqdm bar (default: for more than 256 inputs when stderr is a terminal).

        Returns:
            The vectors, in input order.

        Shapes: -> ``(N, d_model)``.

        Raises:
            ValueError: texts without an attached tokenizer, a bad ``batch_size``, an empty or non-string text,
                a prompt with token ids.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        options = self.embedding_options()
        rows = self.token_rows(texts_or_ids, prompt, options)
        normalize = bool(options.get("normalize", False)) if normalize is None else normalize
        if any(not row for row in rows):
            raise ValueError("a text encodes to no tokens; embed needs at least one token per text")
        device = next(self.parameters()).device
        out = torch.empty(len(rows), self.config.d_model, dtype=torch.float32, device=device)
        forwards = packed_batches([len(row) for row in rows], batch_size)
        show = progress if progress is not None else len(rows) > PROGRESS_THRESHOLD and sys.stderr.isatty()
        if show:
            from tqdm.auto import tqdm

            forwards = tqdm(forwards, desc="embed", unit="batch")
        pad = 0 if self.config.pad_token_id is None else self.config.pad_token_id
        pooling = options.get("pooling", self.default_pooling)
        for packed in forwards:
            width = max(sum(len(rows[i]) for i in row) for row in packed)
            ids = torch.full((len(packed), width), pad, dtype=torch.long)
            documents = torch.full((len(packed), width), -1, dtype=torch.long)
            texts = [i for row in packed for i in row]
            slot = {i: k for k, i in enumerate(texts)}
            for r, row in enumerate(packed):
                at = 0
                for i in row:
                    ids[r, at:at + len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
                    documents[r, at:at + len(rows[i])] = slot[i]
                    at += len(rows[i])
            ids, documents = ids.to(device), documents.to(device)
            mask = documents >= 0
            several = any(len(row) > 1 for row in packed)
            hidden = self.final_hidden(ids, None if bool(mask.all()) else mask,
                                       documents if several else None)  # (rows, width, d_model)
            vectors = pool_documents(hidden, documents, len(texts), pooling).float()
            if normalize:
                vectors = nn.functional.normalize(vectors, p=2, dim=-1)
            out[torch.tensor(texts, device=device)] = vectors
        return out

    def token_rows(
        self, texts_or_ids: Any, prompt: str | None, options: dict[str, Any]
    ) -> list[list[int]]:
        """Token-id lists of ``embed``'s input, truncated at the maximum sequence length.

        Args:
            texts_or_ids: what ``embed`` received.
            prompt: a prompt name or string, or None.
            options: the embedding head's options.

        Returns:
            One id list per input.

        Raises:
            ValueError: texts without a tokenizer, a prompt with token ids, empty id lists, or inputs of another kind.
        """
        limit = options.get("max_seq_length") or self.config.max_len
        if isinstance(texts_or_ids, Tensor):
            if prompt is not None:
                raise ValueError("prompt applies to texts, not to token ids")
            self.check_ids(texts_or_ids, "texts_or_ids")
            return [row[:limit] for row in texts_or_ids.tolist()]
        items = [texts_or_ids] if isinstance(texts_or_ids, str) else list(texts_or_ids)
        if items and not isinstance(items[0], str):
            if prompt is not None:
                raise ValueError("prompt applies to texts, not to token ids")
            rows = [list(row) for row in items]
            if any(not row or not all(isinstance(t, int) and not isinstance(t, bool) for t in row) for row in rows):
                raise ValueError("token-id rows must be non-empty lists of integers")
            for row in rows:
                self.check_ids(torch.tensor([row]), "texts_or_ids")
            return [row[:limit] for row in rows]
        bad = [t for t in items if not isinstance(t, str)]
        if bad:
            raise ValueError(f"embed takes texts (str) or token ids; got {type(bad[0]).__name__} {bad[0]!r}")
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("embed of texts needs a tokenizer: load one with the model or set model.tokenizer")
        prompts = options.get("prompts") or {}
        prompt = options.get("default_prompt_name") if prompt is None else prompt
        if prompt is not None:
            items = [prompts.get(prompt, prompt) + t for t in items]
        if not items:
            return []
        encoded = tokenizer(items, padding=False, truncation=True, max_length=limit, return_tensors=None)
        return encoded["input_ids"]
