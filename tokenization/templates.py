"""Post-processing templates: where each model family wants its special tokens.

- ``encoder`` (BERT-style, ``[CLS] A [SEP]`` with the begin/end tokens in those seats):
  ``[BOS] A [EOS]`` and, for pairs, ``[BOS] A [EOS] B [EOS]`` with segment ids 0 then 1.
- ``decoder`` (GPT-style): ``[BOS] A [EOS]``; pairs ``[BOS] A B [EOS]`` (segment 1 from B on).
- ``seq2seq`` (encoder-decoder source and target, as T5/Marian): ``A [EOS]``; the decoder start token is
  added by the seq2seq collator when it shifts the target right.
- ``none``: no special tokens are added.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import processors

FAMILIES = ("encoder", "decoder", "seq2seq", "none")

_TEMPLATES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # family: (single, pair, roles the template needs)
    "encoder": ("{bos} $A:0 {eos}", "{bos} $A:0 {eos} $B:1 {eos}:1", ("bos", "eos")),
    "decoder": ("{bos} $A:0 {eos}", "{bos} $A:0 $B:1 {eos}:1", ("bos", "eos")),
    "seq2seq": ("$A:0 {eos}", "$A:0 {eos} $B:1 {eos}:1", ("eos",)),
}


def template_processor(family: str, tokens: Mapping[str, tuple[str, int] | None]) -> processors.PostProcessor | None:
    """The ``tokenizers`` post-processor for a model family.

    Args:
        family: one of ``FAMILIES``.
        tokens: role -> ``(token, id)`` (or None when the tokenizer has no token for the role).

    Returns:
        A ``TemplateProcessing`` post-processor, or None for ``"none"``.

    Raises:
        ValueError: an unknown family, or a family whose template needs a role the tokenizer lacks.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown template family {family!r}; expected one of {list(FAMILIES)}")
    if family == "none":
        return None
    single, pair, needed = _TEMPLATES[family]
    missing = [role for role in needed if tokens.get(role) is None]
    if missing:
        raise ValueError(f"the {family!r} template needs special token(s) for role(s) {missing}, which are unset")
    names = {role: tokens[role][0] for role in needed}  # type: ignore[index]
    return processors.TemplateProcessing(
        single=single.format(**names),
        pair=pair.format(**names),
        special_tokens=[tokens[role] for role in needed],  # type: ignore[misc]
    )
