"""llama.cpp's byte-level BPE pre-tokenizers (``tokenizer.ggml.pre``) as ``tokenizers`` pre-tokenizers.

A byte-level GGUF vocabulary (``tokenizer.ggml.model = "gpt2"``) names how text is cut into words before BPE
runs by a short string, ``tokenizer.ggml.pre``. llama.cpp (``src/llama-vocab.cpp``: the name -> pre-type chain in
``llama_vocab::impl::load`` and the per-type list of regular expressions in ``llm_tokenizer_bpe``) turns that name
into a list of regular expressions applied one after the other: each splits every piece the previous ones left,
keeping both what it matched and what lies between matches as pieces (``unicode_regex_split``). Then the bytes of
each piece are mapped to GPT-2's printable alphabet and merged.

That is exactly a ``tokenizers`` ``Sequence`` of ``Split(pattern, behavior="isolated")`` followed by
``ByteLevel(use_regex=False)``, which is how the original models' ``tokenizer.json`` files are written too. Where
llama.cpp rewrote a pattern for C++'s ``std::regex`` (``(?i:'s|...)`` spelled ``'[sS]|...``, possessive quantifiers
made greedy, ``\\p{Lu}`` classes emulated with look-aheads) and records the original ``tokenizer.json`` pattern
beside it, the original is used here: ``tokenizers`` runs it as the model's own tokenizer does. Two split rules that
llama.cpp implements in code rather than as a regex (Kimi-K2's, and AFMoE's digit grouping) are written as the
patterns they implement.

Pre-types that are not byte-level (``gemma4``, ``sarvam-moe``, ``granite-embed-multi-311m``: SentencePiece-style
BPE over raw UTF-8; ``whitespace``) are not in the table, so a vocabulary naming them is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

# --- the patterns (``tokenizer.json`` spelling where llama.cpp records it). Compatibility code points that Unicode
# normalization would fold (U+F900, U+1F7D, U+212A ...) are written as escapes so that no editor changes them.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
         r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's own spelling only (no tokenizer.json original recorded): look-aheads that let marks join letters.
_APOS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GRANITE_EMBED_MULTI = (
    rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))*((?=[\p{{L}}\p{{M}}])([^A-Z]))+{_APOS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))+((?=[\p{{L}}\p{{M}}])([^A-Z]))*{_APOS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
YOUTU = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_APOS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_APOS}?"
         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
YOUTU_CJK = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+"
_NO_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NO_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
# Kimi-K2 (tokenization_kimi.py's pattern, which llama.cpp's unicode_regex_split_custom_kimi_k2 implements by hand).
KIMI_K2 = (rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_NO_HAN_UPPER}*{_NO_HAN_LOWER}+{_CONTRACTIONS}?"
           rf"|[^\r\n\p{{L}}\p{{N}}]?{_NO_HAN_UPPER}+{_NO_HAN_LOWER}*{_CONTRACTIONS}?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
# AFMoE: a digit run is cut into its leading len % 3 digits, then groups of three (llama.cpp does it in code).
AFMOE_DIGITS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
AFMOE_CJK = "[一-鿿㐀-䶿\uf900-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+"
PUNCT_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPARK_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
CJK_KANA = "[一-龥぀-ゟ゠-ヿ]+"
CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
DEEPSEEK_LETTERS = (
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ\u1f5f-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌ\u1fd0-\u1fd3\u1fd6-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
)
DEEPSEEK_PUNCT = r"\s?[!-/:-~！-／：-～‘-‟　-。]+"
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
BAILINGMOE = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
              r"|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM5 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")
LAGUNA = (_APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-type: its split patterns in order, and the vocabulary flags llama.cpp sets with it.

    ``ignore_merges``: a whole piece found in the vocabulary is taken before merging (llama.cpp's
    ``ignore_merges``, the ``tokenizer.json`` BPE flag of the same name). ``add_bos``: llama.cpp's default for
    adding BOS when the file does not say (``tokenizer.ggml.add_bos_token``).

    Attributes:
        splits: the split regular expressions, in order.
        ignore_merges: take a whole piece found in the vocabulary before merging.
        add_bos: llama.cpp's default for adding BOS.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False

    def build(self) -> pre_tokenizers.PreTokenizer:
        """The ``tokenizers`` pre-tokenizer: each pattern splits (isolated), then bytes -> GPT-2's alphabet.

        Returns:
            The pre-tokenizer.
        """
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.splits]
        return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _names(names: str, entry: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), entry)


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

#: ``tokenizer.ggml.pre`` -> how llama.cpp pre-tokenizes (names grouped as llama.cpp groups them).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)),
    **_names("dbrx smaug-bpe glm4 chatglm-bpe", PreTokenizer((LLAMA3,))),
    "jais-2": PreTokenizer((JAIS2,)),
    "deepseek-llm": PreTokenizer(("[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCT, r"\s+$", CJK_HANGUL, r"\p{N}+")),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizer((r"\p{N}{1,3}", CJK_KANA, PUNCT_WORDS))),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", CJK_KANA, SPARK_WORDS, r"\p{N}")),
    "youtu": PreTokenizer((YOUTU_CJK, YOUTU), ignore_merges=True),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             PreTokenizer((r"\p{N}", GPT2))),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 "
             "jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling", PreTokenizer((GPT2,))),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
             PreTokenizer((QWEN2,))),
    "qwen35": PreTokenizer((QWEN35,)),
    **_names("poro-chat bloom gpt3-finnish", PreTokenizer((BLOOM,))),
    "viking": PreTokenizer((BLOOM, r"\p{N}")),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizer((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                               r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2), add_bos=True),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((GPT4O,))),
    "granite-embed-multi-97m": PreTokenizer((GRANITE_EMBED_MULTI,), ignore_merges=True),
    **_names("tiny_aya cohere2moe", PreTokenizer((TINY_AYA_DIGITS, GPT4O))),
    "kimi-k2": PreTokenizer((KIMI_K2,)),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **_names("bailingmoe bailingmoe2 llada-moe", PreTokenizer((BAILINGMOE,))),
    "seed-coder": PreTokenizer((SEED_CODER,)),
    "ufakzeka": PreTokenizer((UFAKZEKA,)),
    "afmoe": PreTokenizer((AFMOE_DIGITS, AFMOE_CJK, PUNCT_WORDS)),
    "laguna": PreTokenizer((LINES, LAGUNA)),
    "exaone-moe": PreTokenizer((EXAONE_MOE,)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", MINICPM5), ignore_merges=True),
}

#: Pre-types llama.cpp knows that are not byte-level BPE, with what they are instead.
NOT_BYTE_LEVEL = {
    "gemma4": "SentencePiece-style BPE over raw UTF-8",
    "granite-embed-multi-311m": "SentencePiece-style BPE over raw UTF-8",
    "sarvam-moe": "SentencePiece-style BPE over raw UTF-8",
    "whitespace": "a whitespace word splitter",
}


def pre_tokenizer_for(pre: str | None) -> PreTokenizer:
    """The entry for a ``tokenizer.ggml.pre`` value; a missing value is llama.cpp's ``default``.

    Args:
        pre: the file's ``tokenizer.ggml.pre``, or None.

    Returns:
        The pre-type.

    Raises:
        ValueError: a value llama.cpp's table does not have, or one that is not byte-level BPE.
    """
    if pre is None:
        return _DEFAULT
    if pre in NOT_BYTE_LEVEL:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is {NOT_BYTE_LEVEL[pre]}, not a byte-level BPE "
                         "pre-tokenizer; it is not supported")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"byte-level GGUF vocabulary with tokenizer.ggml.pre={pre!r}: its split pattern is unknown; "
                         f"expected one of llama.cpp's {len(PRE_TOKENIZERS)} pre-tokenizer names, e.g. "
                         f"{sorted(PRE_TOKENIZERS)[:8]}")
    return PRE_TOKENIZERS[pre]


# The names written for a pre-tokenizer that several names share (the ones llama.cpp's converter writes).
_PREFERRED = ("gpt-2", "llama-bpe", "qwen2", "smollm", "tekken", "gpt-4o", "deepseek-v3", "dbrx")


def _signature(pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> tuple:
    """What a pre-tokenizer does, from its JSON: the steps in order, ignoring offset-only options."""
    probe = Tokenizer(models.BPE())
    probe.pre_tokenizer = pre_tokenizer
    state = json.loads(probe.to_str())["pre_tokenizer"]
    steps = state.get("pretokenizers", [state]) if state else []
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            out.append((kind, step.get("add_prefix_space"), step.get("use_regex")))
        elif kind == "Split":
            pattern = json.dumps(step.get("pattern"), sort_keys=True)
            out.append((kind, pattern, step.get("behavior"), step.get("invert")))
        elif kind == "Digits":
            out.append((kind, step.get("individual_digits")))
        else:
            out.append((kind, json.dumps(step, sort_keys=True)))
    return tuple(out)


def pre_name_of(pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> str | None:
    """The ``tokenizer.ggml.pre`` value under which llama.cpp splits as ``pre_tokenizer`` does, or None.

    Recognised: every table entry as ``PreTokenizer.build`` makes it, GPT-2's ``ByteLevel(use_regex=True)``
    (``gpt-2``) and SmolLM's individual ``Digits`` before it (``smollm``).

    Args:
        pre_tokenizer: a ``tokenizers`` pre-tokenizer, or None.

    Returns:
        The ``pre`` name, or None when llama.cpp has none for it.
    """
    signature = _signature(pre_tokenizer)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if signature == _signature(byte_level):
        return "gpt-2"
    if signature == _signature(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])):
        return "smollm"
    names = [*_PREFERRED, *(n for n in PRE_TOKENIZERS if n not in _PREFERRED)]
    return next((name for name in names if _signature(PRE_TOKENIZERS[name].build()) == signature), None)
