"""The tokenizer embedded in a GGUF file (llama.cpp's format), rebuilt as a ``tokenization.Tokenizer``.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, its scores or merges, the token types and the
special-token ids as metadata under llama.cpp's key names (``tokenizer.ggml.*``). Two vocabularies cover the
llama architecture:

- ``tokenizer.ggml.model = "llama"``: a SentencePiece BPE vocabulary (Llama 1/2, Mistral). The file gives
  each piece a score and no merges; merging the adjacent pair whose result scores highest is the same as a
  BPE whose merges are ranked by that score, so the merges are derived from the scores. Bytes with no piece
  fall back to the ``<0xNN>`` tokens; a space becomes ``▁`` and one is prepended to the text.
- ``tokenizer.ggml.model = "gpt2"``: a byte-level BPE with explicit merges (Llama 3), split beforehand by the
  regular expression that ``tokenizer.ggml.pre`` names.

A file that embeds the whole ``tokenizer.json`` (``tokenizer.huggingface.json``) is read as it is. This module
needs only ``tokenizers``; reading the file is ``models.gguf``'s job.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as Backend

from .gguf_pretokenizers import pre_name_of, pre_tokenizer_for
from .gguf_unigram import SPACE as _SPACE
from .gguf_unigram import unigram_backend
from .heap import release_freed_memory
from .string_table import StringTable
from .tokenizer import Tokenizer

# llama.cpp's token types (``llama_token_type``): which tokens are matched whole in the text.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_ROLE_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}

# Ids llama.cpp reads beside the roles a ``Tokenizer`` has: end of turn / message, separator, fill-in-the-middle.
_EXTRA_ID_KEYS = ("eot", "eom", "sep", "cls", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")

SUPPORTED_MODELS = ("llama", "gpt2", "t5")

# The long lists of strings, which ``GGUFTokenizer.metadata`` keeps as ``StringTable`` s.
_STRING_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


class GGUFTokenizer(Tokenizer):
    """A ``Tokenizer`` read from a GGUF file, with what the file says beside the vocabulary.

    The arguments are kept as attributes of the same names.

    Args:
        backend: the ``tokenizers.Tokenizer`` built from the file's vocabulary.
        special_tokens: role -> token string.
        chat_template: ``tokenizer.chat_template`` (a Jinja template), or None.
        add_bos_token: whether encoding adds BOS (the post-processor does it).
        add_eos_token: whether encoding adds EOS.
        special_ids: further special-token ids the file names (``eot``, ``eom``, ``sep``, ``fim_*`` ...).
        model: ``tokenizer.ggml.model`` (None where the file has none).
        pre: ``tokenizer.ggml.pre`` (None where the file has none).
        metadata: every ``tokenizer.*`` key of the file (what ``save_gguf`` writes back); the tokens and the
            merges as ``tokenization.string_table.StringTable`` s (lists of strings would cost ~5x the memory).
    """

    def __init__(self, backend: Backend, special_tokens: Mapping[str, str | None] | None = None, *,
                 chat_template: str | None = None, add_bos_token: bool = False, add_eos_token: bool = False,
                 special_ids: Mapping[str, int] | None = None, model: str | None = None,
                 pre: str | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, special_tokens)
        self.metadata = dict(metadata or {})
        self.chat_template, self.model, self.pre = chat_template, model, pre
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.special_ids = dict(special_ids or {})

#: The longest piece of a SentencePiece vocabulary whose merges are derived from its scores (SentencePiece's own
#: trainer caps ``max_sentencepiece_length`` at 512).
MAX_PIECE_CHARS = 512


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file's metadata describes.

    What the tokenizer costs is ``tokenizers``' own vocabulary and merges: the Python lists it is built from are
    decoded once, their strings shared by the vocabulary and the merges, dropped once built and the freed heap
    given back to the system (``tokenization.heap``); the metadata it keeps holds the tokens and merges as
    ``StringTable`` s (UTF-8 bytes).

    Args:
        metadata: the file's key -> value metadata (arrays as Python lists; the tokens and merges may also be
            ``tokenization.string_table.StringTable`` s, as ``models.gguf`` reads them); only the
            ``tokenizer.*`` keys are used.

    Returns:
        A ``GGUFTokenizer`` (a ``Tokenizer`` that also keeps the chat template and the other special ids)
        with the file's vocabulary (ids as in the file), its special tokens in their roles
        (bos, eos, unk, pad from the ``tokenizer.ggml.*_token_id`` keys) and a post-processor that adds BOS
        and EOS as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say (llama.cpp's defaults otherwise:
        BOS for a SentencePiece vocabulary, nothing for a byte-level one).

    Raises:
        ValueError: no vocabulary, a tokenizer model other than ``llama``/``gpt2``, a byte-level ``pre`` type
            with no known split pattern, or lists and ids that do not fit the vocabulary.
    """
    tokenizer = _tokenizer_from_gguf(metadata)
    release_freed_memory()  # the temporaries of a 150k-token vocabulary leave ~20 MiB of free heap behind
    return tokenizer


def _tokenizer_from_gguf(metadata: Mapping[str, Any]) -> GGUFTokenizer:
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a mapping of GGUF keys to values, got {type(metadata).__name__}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, (list, StringTable)) or not tokens:
        raise ValueError("the GGUF metadata has no tokenizer.ggml.tokens list, so it embeds no tokenizer")
    if isinstance(tokens, list):  # a StringTable holds strings only
        bad = next((i for i, token in enumerate(tokens) if not isinstance(token, str)), None)
        if bad is not None:
            raise ValueError(f"tokenizer.ggml.tokens[{bad}]={tokens[bad]!r}: expected a list of strings")
    hf_json = metadata.get("tokenizer.huggingface.json")
    if isinstance(hf_json, str):
        # The file carries the exact tokenizer.json it was converted from: nothing to rebuild.
        try:
            whole = Tokenizer.from_str(hf_json)
        except Exception as err:  # tokenizers raises its own bare Exception on a bad document
            raise ValueError(f"tokenizer.huggingface.json is not a tokenizer.json the tokenizers library reads: "
                             f"{err}") from err
        size = whole.vocab_size
        named = {role: metadata[key] for role, key in _ROLE_KEYS.items() if metadata.get(key) is not None}
        ids = {role: i for role, i in named.items() if isinstance(i, int) and 0 <= i < size}
        if len(ids) != len(named):
            raise ValueError(f"special-token ids {named} do not all fit the embedded tokenizer.json of {size} tokens")
        return GGUFTokenizer(whole.backend, {role: whole.id_to_token(i) for role, i in ids.items()},
                             **_extras(metadata, size, False, False))
    tokens = tokens.tolist() if isinstance(tokens, StringTable) else tokens  # each string decoded once, here
    roles = _roles(metadata, tokens)

    kind = metadata.get("tokenizer.ggml.model")
    token_types = _int_list(metadata, "tokenizer.ggml.token_type", len(tokens))
    default_eos = False
    if kind == "llama":
        add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        backend = _sentencepiece_bpe(tokens, _scores(metadata, len(tokens)), metadata.get("tokenizer.ggml.merges"),
                                     roles["unk"], add_prefix)
        default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    elif kind == "t5":  # SentencePiece Unigram (llama.cpp's UGM): EOS added, no BOS
        backend = unigram_backend(tokens, _scores(metadata, len(tokens)), metadata)
        default_bos, default_eos = False, True
    elif kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise ValueError(f"tokenizer.ggml.pre={pre!r}: expected a string naming a llama.cpp pre-tokenizer")
        splitter = pre_tokenizer_for(pre)
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, (list, StringTable)):
            raise ValueError("a byte-level (gpt2) GGUF vocabulary needs tokenizer.ggml.merges, which is missing")
        vocab = {token: i for i, token in enumerate(tokens)}
        backend = Backend(_bpe(vocab, _split_merges(merges, vocab, tokens), ignore_merges=splitter.ignore_merges))
        backend.pre_tokenizer = splitter.build()
        backend.decoder = decoders.ByteLevel()
        default_bos = splitter.add_bos
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; expected one of {list(SUPPORTED_MODELS)}")

    _add_whole_tokens(backend, tokens, token_types, roles)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", default_eos))
    backend.post_processor = _template(tokens, metadata, add_bos, add_eos)
    return GGUFTokenizer(backend, roles, **_extras(metadata, len(tokens), add_bos, add_eos))


def _extras(metadata: Mapping[str, Any], size: int, add_bos: bool, add_eos: bool) -> dict[str, Any]:
    """The ``GGUFTokenizer`` attributes beyond the roles, each checked."""
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"tokenizer.chat_template={template!r}: expected a string (a Jinja template)")
    special_ids = {}
    for name in _EXTRA_ID_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ValueError(f"{key}={value!r} is not an id of the {size}-token vocabulary")
        special_ids[name] = value
    return {"chat_template": template, "add_bos_token": add_bos, "add_eos_token": add_eos,
            "special_ids": special_ids, "model": metadata.get("tokenizer.ggml.model"),
            "pre": metadata.get("tokenizer.ggml.pre"),
            "metadata": {k: StringTable(v) if k in _STRING_KEYS and _all_strings(v) else v
                         for k, v in metadata.items() if k.startswith("tokenizer.")}}


def _all_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _scores(metadata: Mapping[str, Any], length: int) -> list[float]:
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != length:
        got = len(scores) if isinstance(scores, list) else scores
        raise ValueError(f"tokenizer.ggml.scores must list one score per token ({length}), got {got!r}")
    bad = next((i for i, v in enumerate(scores) if isinstance(v, bool) or not isinstance(v, (int, float))
                or not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"tokenizer.ggml.scores[{bad}]={scores[bad]!r}: expected finite numbers")
    return scores


def _roles(metadata: Mapping[str, Any], tokens: Sequence[str]) -> dict[str, str | None]:
    roles: dict[str, str | None] = {}
    for role, key in _ROLE_KEYS.items():
        token_id = metadata.get(key)
        if token_id is None:
            roles[role] = None
        elif isinstance(token_id, int) and 0 <= token_id < len(tokens):
            roles[role] = tokens[token_id]
        else:
            raise ValueError(f"{key}={token_id!r} is not an id of the {len(tokens)}-token vocabulary")
    return roles


def _int_list(metadata: Mapping[str, Any], key: str, length: int) -> list[int]:
    values = metadata.get(key)
    if values is None:
        return [1] * length  # every token normal
    if not isinstance(values, list) or len(values) != length:
        got = len(values) if isinstance(values, list) else values
        raise ValueError(f"{key} must list one value per token ({length}), got {got!r}")
    bad = next((i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise ValueError(f"{key}[{bad}]={values[bad]!r}: expected integers")
    return values


def _sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], merges: Sequence[str] | None, unk: str | None, add_prefix: bool
) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = (_split_merges(merges, vocab, tokens) if isinstance(merges, (list, StringTable))
             else _merges_from_scores(vocab, scores))
    backend = Backend(_bpe(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # llama.cpp (like SentencePiece) prepends a space to every run of text, also after a special token and
    # also when the text starts with spaces; a normalizer does that, since special tokens are split off first.
    # (transformers' Metaspace prepend_scheme="first" skips texts that start with a space.)
    spaces = normalizers.Replace(" ", _SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if add_prefix else spaces
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked by the score of the piece they make, best first.

    Ties go to the longer left part, then the longer right part, then the lower id of the piece made
    (the order SentencePiece's own converter, and transformers', give them).
    """
    too_long = next(((i, len(p)) for p, i in vocab.items() if len(p) > MAX_PIECE_CHARS), None)
    if too_long is not None:  # each cut of a piece copies it: a long one would take time and memory squared
        raise ValueError(f"tokenizer.ggml.tokens[{too_long[0]}] is {too_long[1]} characters long; a SentencePiece "
                         f"piece has at most {MAX_PIECE_CHARS} (without tokenizer.ggml.merges its merges are derived)")
    by_id = {i: piece for piece, i in vocab.items()}  # the vocabulary's own strings, so merges copy none
    candidates: list[tuple[float, int, int, int, int]] = []
    for piece, piece_id in vocab.items():  # in id order, which a stable sort keeps for full ties
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left is not None and right is not None:
                candidates.append((-float(scores[piece_id]), -cut, cut - len(piece), left, right))
    candidates.sort(key=lambda c: c[:3])
    return [(by_id[left], by_id[right]) for *_, left, right in candidates]


def _split_merges(merges: Sequence[str], vocab: Mapping[str, int], tokens: Sequence[str]) -> _MergePairs:
    """The file's merges as pairs, each checked: two tokens separated by a space, whose parts and the token they
    make are all in the vocabulary (``tokenizers`` panics, an uncatchable-as-Exception ``PanicException``, on a
    merge that makes a token it does not have). A malformed entry is reported before a merge that does not fit."""
    pairs = _MergePairs(merges, vocab, tokens)
    misfit = None
    for index, (left, right) in enumerate(pairs):  # splitting raises on a malformed entry
        if misfit is None and (left not in vocab or right not in vocab or left + right not in vocab):
            misfit = index
    if misfit is not None:
        left, right = pairs[misfit]
        raise ValueError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: merges[{misfit}]="
                         f"{left + ' ' + right!r}, its parts and the token they make must all be tokens")
    return pairs


class _MergePairs(Sequence[tuple[str, str]]):
    """``"left right"`` merges as ``(left, right)`` pairs of the vocabulary's own strings, split as they are read.

    ``tokenizers`` copies the pairs it is given into its own strings: handing them over one at a time keeps a list
    of 150k tuples (and 300k more strings) out of memory while it builds.
    """

    def __init__(self, merges: Sequence[str], vocab: Mapping[str, int], tokens: Sequence[str]) -> None:
        self._merges, self._vocab, self._tokens = merges, vocab, tokens

    def __len__(self) -> int:
        return len(self._merges)

    def __getitem__(self, index: int) -> tuple[str, str]:  # type: ignore[override]
        return self._pair(self._merges[index])

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return map(self._pair, self._merges)

    def _pair(self, merge: Any) -> tuple[str, str]:
        left, sep, right = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
        if not sep or not left or not right:
            raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
        left_id, right_id = self._vocab.get(left), self._vocab.get(right)
        return (left if left_id is None else self._tokens[left_id],
                right if right_id is None else self._tokens[right_id])


def _bpe(vocab: dict[str, int], merges: Sequence[tuple[str, str]], **options: Any) -> models.BPE:
    """``tokenizers``' BPE over merges known to fit the vocabulary, its refusals raised as ``ValueError``."""
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as err:  # tokenizers raises a bare Exception here
        raise ValueError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {err}") from err


def _add_whole_tokens(
    backend: Backend, tokens: Sequence[str], token_types: Sequence[int], roles: Mapping[str, str | None]
) -> None:
    """Match control tokens (``<s>``, ``<|eot_id|>``), the unknown token and user-defined ones whole.

    llama.cpp never cuts these into pieces; without registering them the BPE would. Control and unknown
    tokens are special (dropped by ``decode(skip_special_tokens=True)``), user-defined ones are not.
    """
    special = {tokens[i] for i, kind in enumerate(token_types) if kind in (_CONTROL, _UNKNOWN)}
    special.update(t for t in roles.values() if t is not None)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens if t in special])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types) if kind == _USER_DEFINED])


def _template(tokens: Sequence[str], metadata: Mapping[str, Any], add_bos: bool, add_eos: bool) -> Any:
    def seat(role: str, wanted: bool) -> tuple[str, int] | None:
        if not wanted:
            return None
        token_id = metadata.get(_ROLE_KEYS[role])
        if token_id is None:
            raise ValueError(f"tokenizer.ggml.add_{role}_token is set but the file has no {_ROLE_KEYS[role]}")
        return tokens[token_id], token_id

    bos, eos = seat("bos", add_bos), seat("eos", add_eos)
    if bos is None and eos is None:
        return None
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=" ".join([*head, "$A:0", *tail]),
        pair=" ".join([*head, "$A:0", *tail, *head, "$B:1", *tail]),
        special_tokens=sorted({s for s in (bos, eos) if s is not None}),
    )


def tokenizer_to_gguf(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata llama.cpp reads for ``tokenizer``: the inverse of ``tokenizer_from_gguf``.

    A ``GGUFTokenizer`` gives back the metadata it was read from. Any other tokenizer must be a byte-level BPE
    (``tokenizers``' ``BPE`` model behind a ``ByteLevel`` pre-tokenizer, no normalizer) whose pre-tokenizer is one
    of llama.cpp's (``tokenization.gguf_pretokenizers.pre_name_of``): its tokens (by id), merges, token types
    (control for special tokens, user-defined for other added tokens), role ids and whether encoding adds BOS/EOS.

    Args:
        tokenizer: the model's tokenizer.

    Returns:
        The ``tokenizer.*`` metadata.

    Raises:
        ValueError: a tokenizer llama.cpp cannot run as it is (another model, a normalizer, an unknown
            pre-tokenizer), naming what.
    """
    if isinstance(tokenizer, GGUFTokenizer) and tokenizer.metadata:
        return {key: value.tolist() if isinstance(value, StringTable) else value
                for key, value in tokenizer.metadata.items()}
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"tokenizer must be a tokenization.Tokenizer, got {type(tokenizer).__name__}")
    backend = tokenizer.backend
    state = json.loads(backend.to_str())
    model = state["model"]
    if model.get("type") != "BPE" or backend.normalizer is not None:
        raise ValueError(f"only a byte-level BPE tokenizer without a normalizer can be written to GGUF; this one has "
                         f"model {model.get('type')!r} and normalizer {state.get('normalizer')!r}")
    pre = pre_name_of(backend.pre_tokenizer)
    if pre is None:
        raise ValueError(f"the tokenizer's pre-tokenizer {state.get('pre_tokenizer')} is none of llama.cpp's; "
                         "a GGUF file could not name it in tokenizer.ggml.pre")
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("the tokenizer's ids are not 0 ... n-1 without gaps, as a GGUF token list needs")
    added = {a["content"]: a["special"] for a in state.get("added_tokens", [])}
    types = [(_CONTROL if added[t] else _USER_DEFINED) if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    with_specials = backend.encode("a").ids
    plain = backend.encode("a", add_special_tokens=False).ids
    out: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": with_specials[:1] != plain[:1],
        "tokenizer.ggml.add_eos_token": with_specials[-1:] != plain[-1:],
    }
    for role, key in _ROLE_KEYS.items():
        token = tokenizer.special_tokens.get(role)
        if token is not None:
            out[key] = vocab[token]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out
