"""Task helpers on text, with the attached tokenizer: ``classify``, ``tag``, ``answer``, ``similarity``.

``TextTasksMixin`` is mixed into ``EncoderLM`` and ``DecoderLM``. Each helper returns what the matching
``transformers`` pipeline returns for the same model (text classification, token classification with word
aggregation, extractive question answering) and ``similarity`` the cosine similarities of ``embed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

AGGREGATIONS = ("first", "average", "max")


class TextTasksMixin:
    """``classify`` / ``tag`` / ``answer`` / ``similarity`` (see the module docstring)."""

    def require_task(self, head: str, helper: str) -> Any:
        """The attached tokenizer, after checking the model has ``head``.

        Args:
            head: the head the helper needs.
            helper: the helper's name, for the message.

        Returns:
            The tokenizer.

        Raises:
            ValueError: another head, or no tokenizer.
        """
        if self.config.head != head:
            raise ValueError(f"{helper} needs a {head!r} head; this model has head={self.config.head!r}")
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{helper} needs a tokenizer: load one with the model or set model.tokenizer")
        return tokenizer

    def label_name(self, index: int) -> str:
        """A class's name (``id2label``, else ``LABEL_<index>``, as ``transformers``).

        Args:
            index: the class id.

        Returns:
            Its name.
        """
        id2label = self.config.block_options("head").get("id2label") or {}
        return id2label.get(str(index), f"LABEL_{index}")

    @torch.no_grad()
    def classify(self, texts: str | Sequence[str], top_k: int | None = 1, batch_size: int = 32) -> Any:
        """Labels and scores per text, as ``transformers``' text-classification pipeline gives them: softmax for
        single-label classifiers, sigmoid for multi-label ones (and ``num_labels == 1``), raw scores for regression.

        Args:
            texts: one text or a list of texts.
            top_k: labels per text, best first (None: all).
            batch_size: texts per forward pass.

        Returns:
            per text ``{"label", "score"}`` (``top_k=1``), else a list of them, best first (``top_k=None``: all);
            a list of those for a list of texts.

        Raises:
            ValueError: no tokenizer, not a sequence classifier, ``texts`` not a string or a list of strings, a bad
                ``top_k`` or ``batch_size`` (each named).
        """
        tokenizer = self.require_task("sequence_classification", "classify")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be None or a positive integer, got {top_k!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        batch = text_list(texts, "texts")
        options = self.config.block_options("head")
        problem = options.get("problem_type")
        results = []
        for start in range(0, len(batch), batch_size):
            logits = self.forward_texts(tokenizer, batch[start:start + batch_size]).logits.float()
            if problem == "regression":
                scores = logits
            elif problem == "multi_label_classification" or logits.shape[-1] == 1:
                scores = torch.sigmoid(logits)
            else:
                scores = logits.softmax(-1)
            for row in scores.tolist():
                ranked = sorted(({"label": self.label_name(i), "score": s} for i, s in enumerate(row)),
                                key=lambda item: -item["score"])
                results.append(ranked[0] if top_k == 1 else ranked[:top_k])
        return results[0] if isinstance(texts, str) else results

    def forward_texts(self, tokenizer: Any, texts: list[str], pairs: list[str] | None = None) -> Any:
        """The model's output on a padded batch of texts (truncated at ``max_len``).

        Args:
            tokenizer: the attached tokenizer.
            texts: the texts.
            pairs: second segments, or None.

        Returns:
            The model's output.

        Raises:
            ValueError: ``texts`` is not a non-empty list of strings.
        """
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"texts must be a non-empty list of strings, got {texts!r}")
        enc = tokenizer(texts, pairs, truncation=True, max_length=self.config.max_len)
        device = next(self.parameters()).device
        extra = {"token_type_ids": enc["token_type_ids"].to(device)} if "token_type_ids" in enc else {}
        return self(enc["input_ids"].to(device), enc["attention_mask"].to(device), **extra)

    @torch.no_grad()
    def tag(self, texts: str | Sequence[str], aggregation: str = "first") -> Any:
        """Word-level entities, as ``transformers``' token-classification pipeline gives them with
        ``aggregation_strategy`` ``first`` / ``average`` / ``max``: tokens joined into words, words into entity groups
        (``B-``/``I-`` tags), the ``O`` label left out.

        Args:
            texts: one text or a list of texts.
            aggregation: how a word's tokens give its label: ``"first"``, ``"average"`` or ``"max"``.

        Returns:
            per text a list of ``{"entity_group", "score", "word", "start", "end"}`` (character offsets).

        Raises:
            ValueError: no tokenizer, not a token classifier, an unknown aggregation.
        """
        tokenizer = self.require_task("token_classification", "tag")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {list(AGGREGATIONS)}")
        batch = text_list(texts, "texts")
        results = []
        for text in batch:
            with plain_settings(tokenizer.backend):
                enc = tokenizer.backend.encode(text)
            ids = torch.tensor([enc.ids[: self.config.max_len]])
            scores = self(ids.to(next(self.parameters()).device)).logits[0].float().softmax(-1).cpu()
            words = self.words(tokenizer, text, enc, scores)
            results.append(group_entities(tokenizer, [aggregate_word(tokenizer, w, aggregation, self.label_name)
                                                      for w in words]))
        return results[0] if isinstance(texts, str) else results

    @staticmethod
    def words(tokenizer: Any, text: str, enc: Any, scores: Tensor) -> list[list[dict[str, Any]]]:
        """The non-special tokens grouped into words by the pipeline's rule (subword prefix, else no space).

        Args:
            tokenizer: the attached tokenizer.
            text: the text.
            enc: its encoding (offsets and tokens).
            scores: the label probabilities of every token.

        Returns:
            Per word, its tokens' ``{"word", "scores", "start", "end"}`` entries.

        Shapes: scores ``(L, num_labels)``.
        """
        prefix = getattr(tokenizer.backend.model, "continuing_subword_prefix", None)
        words: list[list[dict[str, Any]]] = []
        for index in range(len(scores)):
            if enc.special_tokens_mask[index]:
                continue
            start, end = enc.offsets[index]
            token, ref = enc.tokens[index], text[start:end]
            subword = len(token) != len(ref) if prefix else start > 0 and " " not in text[start - 1:start + 1]
            if enc.ids[index] == tokenizer.unk_token_id:
                token, subword = ref, False
            entry = {"word": token, "scores": scores[index], "start": start, "end": end}
            if subword and words:
                words[-1].append(entry)
            else:
                words.append([entry])
        return words

    @torch.no_grad()
    def answer(
        self, question: str, context: str, max_answer_len: int = 30, stride: int | None = None,
        max_seq_len: int = 384,
    ) -> dict[str, Any]:
        """The best answer span in ``context``, as ``transformers``' question-answering pipeline finds it: the span
        (start <= end, at most ``max_answer_len`` tokens, inside the context) maximising the product of the start
        and end probabilities, widened to whole words; long contexts are cut into windows overlapping by ``stride``
        tokens (default ``min(max_seq_len // 2, 128)``; ``max_seq_len`` is capped at the model's ``max_len``) and the
        best span of all windows wins.

        Args:
            question: the question.
            context: the text that holds the answer.
            max_answer_len: the longest answer, in tokens.
            stride: tokens shared by consecutive windows of a long context.
            max_seq_len: tokens per window (question and context).

        Returns:
            ``{"score", "start", "end", "answer"}`` (character offsets into ``context``).

        Raises:
            ValueError: no tokenizer, not a QA model, empty texts, bad lengths, a question that leaves no room for
                context in ``max_seq_len``, a ``stride`` not smaller than the context part of a window (each named).
        """
        tokenizer = self.require_task("question_answering", "answer")
        if not isinstance(question, str) or not isinstance(context, str) or not question or not context:
            raise ValueError("question and context must be non-empty strings")
        max_seq_len = min(max_seq_len, self.config.max_len) if isinstance(max_seq_len, int) else max_seq_len
        stride = min(max_seq_len // 2, 128) if stride is None and isinstance(max_seq_len, int) else stride
        for name, value in (("max_answer_len", max_answer_len), ("stride", stride), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "stride" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        with plain_settings(tokenizer.backend):
            asked = len(tokenizer.backend.encode(question, add_special_tokens=False).ids)
            room = max_seq_len - asked - tokenizer.backend.num_special_tokens_to_add(True)
            if room < 1:
                raise ValueError(f"the question takes {asked} tokens, which leaves no room for the context in "
                                 f"max_seq_len={max_seq_len} (the model's max_len is {self.config.max_len}); "
                                 "shorten the question or raise max_seq_len")
            if stride >= room:
                raise ValueError(f"stride={stride} must be smaller than the {room} context tokens a window of "
                                 f"max_seq_len={max_seq_len} holds beside this question")
            tokenizer.backend.enable_truncation(max_seq_len, stride=stride, strategy="only_second")
            first = tokenizer.backend.encode(question, context)
        best = None
        for enc in [first, *first.overflowing]:
            ids = torch.tensor([enc.ids])
            types = torch.tensor([enc.type_ids]) if getattr(self, "token_type_embed", None) is not None else None
            out = self(ids.to(next(self.parameters()).device), token_type_ids=None if types is None else
                       types.to(ids.device))
            desired = torch.tensor([s == 1 and not special for s, special in zip(
                enc.sequence_ids, enc.special_tokens_mask, strict=True)], dtype=torch.bool)
            keep = desired.clone()
            cls = next((tokenizer.token_to_id(t) for t in ("[CLS]", "<s>") if tokenizer.token_to_id(t) is not None),
                       None)
            if cls is not None:
                keep |= torch.tensor(enc.ids) == cls
            probs = [torch.where(keep, logits.float().cpu(), -10000.0).softmax(-1)
                     for logits in (out.start_logits[0], out.end_logits[0])]
            if cls is not None:
                probs[0][0] = probs[1][0] = 0.0
            outer = torch.triu(probs[0][:, None] * probs[1][None, :])
            outer = torch.tril(outer, max_answer_len - 1) * (desired[:, None] & desired[None, :])
            flat = int(outer.argmax())
            s, e = divmod(flat, outer.shape[1])
            score = float(outer[s, e])
            if best is None or score > best[0]:
                start = enc.word_to_chars(enc.token_to_word(s), 1)[0]
                end = enc.word_to_chars(enc.token_to_word(e), 1)[1]
                best = (score, start, end)
        score, start, end = best
        return {"score": score, "start": start, "end": end, "answer": context[start:end]}

    def similarity(self, a: str | Sequence[str], b: str | Sequence[str], batch_size: int = 32) -> Tensor:
        """Cosine similarities of the ``embed`` vectors (sentence-transformers' default).

        Args:
            a: one text or a list of texts.
            b: one text or a list of texts.
            batch_size: texts per forward pass.

        Returns:
            The similarity of each text of ``a`` to each text of ``b``.

        Shapes: -> ``(len(a), len(b))``.
        """
        left = nn.functional.normalize(self.embed(a, batch_size=batch_size), dim=-1)
        right = nn.functional.normalize(self.embed(b, batch_size=batch_size), dim=-1)
        return left @ right.T


@contextlib.contextmanager
def plain_settings(backend: Any) -> Iterator[None]:
    """No padding and no truncation inside (the caller may set its own), then the backend's own settings again.

    Args:
        backend: a ``tokenizers.Tokenizer``.

    Yields:
        Nothing; the settings hold inside the ``with`` block.
    """
    padding, truncation = backend.padding, backend.truncation
    backend.no_padding()
    backend.no_truncation()
    try:
        yield
    finally:
        backend.no_padding()
        backend.no_truncation()
        if padding is not None:
            backend.enable_padding(**padding)
        if truncation is not None:
            backend.enable_truncation(**truncation)


def tokens_to_string(tokenizer: Any, tokens: list[str]) -> str:
    """Tokens back to text with the tokenizer's decoder (joined by spaces without one).

    Args:
        tokenizer: the attached tokenizer.
        tokens: token strings.

    Returns:
        The text.
    """
    decoder = tokenizer.backend.decoder
    return decoder.decode(tokens) if decoder is not None else " ".join(tokens)


def aggregate_word(tokenizer: Any, entries: list[dict[str, Any]], aggregation: str, name: Any) -> dict[str, Any]:
    """One word's label and score from its tokens (the pipeline's ``first`` / ``max`` / ``average``).

    Args:
        tokenizer: the attached tokenizer.
        entries: the word's tokens (from ``words``).
        aggregation: ``"first"``, ``"max"`` or ``"average"``.
        name: maps a class id to its name.

    Returns:
        ``{"entity", "score", "word", "start", "end"}``.
    """
    if aggregation == "first":
        scores = entries[0]["scores"]
    elif aggregation == "max":
        scores = max(entries, key=lambda entry: float(entry["scores"].max()))["scores"]
    else:
        scores = torch.stack([entry["scores"] for entry in entries]).mean(0)
    index = int(scores.argmax())
    return {"entity": name(index), "score": float(scores[index]),
            "word": tokens_to_string(tokenizer, [entry["word"] for entry in entries]),
            "start": entries[0]["start"], "end": entries[-1]["end"]}


def split_tag(label: str) -> tuple[str, str]:
    """``("B" | "I", type)`` of a ``B-``/``I-`` label; other labels count as ``I``.

    Args:
        label: a class name.

    Returns:
        ``(tag, type)``.
    """
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def group_entities(tokenizer: Any, words: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent words of one type (a ``B-`` starts a new group) as entity groups; ``O`` left out.

    Args:
        tokenizer: the attached tokenizer.
        words: the labelled words (from ``aggregate_word``).

    Returns:
        ``{"entity_group", "score", "word", "start", "end"}`` per group.
    """
    groups: list[list[dict[str, Any]]] = []
    for word in words:
        if groups and split_tag(word["entity"])[1] == split_tag(groups[-1][-1]["entity"])[1] \
                and split_tag(word["entity"])[0] != "B":
            groups[-1].append(word)
        else:
            groups.append([word])
    out = []
    for group in groups:
        label = group[0]["entity"].split("-", 1)[-1]
        if label == "O":
            continue
        out.append({"entity_group": label, "score": sum(w["score"] for w in group) / len(group),
                    "word": tokens_to_string(tokenizer, [w["word"] for w in group]),
                    "start": group[0]["start"], "end": group[-1]["end"]})
    return out


def text_list(texts: Any, name: str) -> list[str]:
    """``texts`` (one string or a sequence of them) as a non-empty list of strings.

    Args:
        texts: what the caller passed.
        name: the argument's name, for messages.

    Returns:
        The list.

    Raises:
        ValueError: anything else, naming the argument and what it got.
    """
    batch = [texts] if isinstance(texts, str) else list(texts) if isinstance(texts, (list, tuple)) else None
    if not batch or not all(isinstance(t, str) for t in batch):
        shown = texts if batch is None else next((t for t in batch or [] if not isinstance(t, str)), texts)
        raise ValueError(f"{name} must be a string or a non-empty list of strings, got {type(shown).__name__} "
                         f"{shown!r:.80}")
    return batch
