"""Text normalisation before tokenization: a Unicode normal form, lowercasing, accent stripping."""

from __future__ import annotations

from tokenizers import normalizers

UNICODE_FORMS: dict[str, type[normalizers.Normalizer]] = {
    "nfc": normalizers.NFC,
    "nfd": normalizers.NFD,
    "nfkc": normalizers.NFKC,
    "nfkd": normalizers.NFKD,
}


def build_normalizer(
    unicode_form: str | None = "nfkc", *, lowercase: bool = False, strip_accents: bool = False
) -> normalizers.Normalizer | None:
    """A ``tokenizers`` normalizer: the Unicode form, then accent stripping, then lowercasing.

    Args:
        unicode_form: "nfc", "nfd", "nfkc", "nfkd" or None (leave the text as is).
        lowercase: lowercase everything (uncased models).
        strip_accents: drop combining marks; needs a decomposed form ("nfd" or "nfkd"), where accents
            are separate code points.

    Returns:
        The normalizer, or None when nothing is asked for (byte-level tokenizers then round-trip exactly).

    Raises:
        ValueError: an unknown form, or ``strip_accents`` without a decomposed form.
    """
    if unicode_form is not None and unicode_form not in UNICODE_FORMS:
        raise ValueError(f"unicode_form must be one of {sorted(UNICODE_FORMS)} or None, got {unicode_form!r}")
    if strip_accents and unicode_form not in ("nfd", "nfkd"):
        raise ValueError(f"strip_accents=True needs unicode_form 'nfd' or 'nfkd', got {unicode_form!r}")
    steps: list[normalizers.Normalizer] = []
    if unicode_form is not None:
        steps.append(UNICODE_FORMS[unicode_form]())
    if strip_accents:
        steps.append(normalizers.StripAccents())
    if lowercase:
        steps.append(normalizers.Lowercase())
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else normalizers.Sequence(steps)
