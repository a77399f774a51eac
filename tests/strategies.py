"""Shared hypothesis strategies for the zoo's tests.

Tensors are drawn as a shape plus an integer seed: hypothesis shrinks the shape, torch fills the values from
a private generator, so examples are cheap, reproducible and independent of the global RNG.

Main entry points:

- ``attention_shapes()`` -> ``AttentionShape`` (B, H, Hkv with ``H % Hkv == 0``, Lq, Lk, D, Dv) and
  ``qkv(shape)`` -> ``(q, k, v)`` in the backend layout;
- ``attention_masks(b, h, lq, lk)``: None, random bool masks of every broadcastable shape (some query rows
  fully masked), or a mask of a registered kind (``registered_masks``), optionally combined with ``&``;
- ``attention_biases(b, h, lq, lk)``: None, a random additive bias of a broadcastable shape, or an ALiBi bias;
- ``padding_masks(b, length)``: ``(B, L)`` bool, True = real token;
- ``registry_names(kind)``: any registered name of a component kind;
- ``model_dims()``: a consistent ``(d_model, n_heads, n_kv_heads, d_head)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

import blocks
from blocks.positional import ALiBiPositionalBias

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid ``n_kv_heads`` for ``n`` query heads)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def randn(shape: Sequence[int], seed: int, *, scale: float = 1.0, requires_grad: bool = False) -> Tensor:
    """Standard-normal fp32 tensor from a private generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(tuple(shape), generator=gen) * scale
    return t.requires_grad_(requires_grad)


def rand_bool(shape: Sequence[int], seed: int, p_true: float) -> Tensor:
    """Bool tensor with each entry True with probability ``p_true``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tuple(shape), generator=gen) < p_true


# ----------------------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one backend call: q ``(b, h, lq, d)``, k ``(b, hkv, lk, d)``, v ``(b, hkv, lk, dv)``."""

    b: int
    h: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int

    @property
    def scores(self) -> tuple[int, int, int, int]:
        """``(B, H, Lq, Lk)``, the shape masks and biases broadcast to."""
        return (self.b, self.h, self.lq, self.lk)


@st.composite
def attention_shapes(
    draw: st.DrawFn,
    *,
    max_batch: int = 3,
    max_heads: int = 6,
    max_len: int = 12,
    max_dim: int = 16,
    min_len: int = 1,
    lengths: str = "any",
    value_dim: str = "any",
) -> AttentionShape:
    """Backend-call sizes covering MHA (``Hkv == H``), GQA and MQA (``Hkv == 1``).

    Args:
        lengths: ``"any"`` (Lq and Lk independent), ``"equal"`` (Lq == Lk) or ``"lq_le_lk"`` (Lq <= Lk,
            a query block after a cache).
        value_dim: ``"any"`` (Dv sometimes != D) or ``"same"`` (Dv == D).
    """
    h = draw(st.integers(1, max_heads))
    hkv = draw(st.sampled_from(divisors(h)))
    lk = draw(st.integers(min_len, max_len))
    if lengths == "equal":
        lq = lk
    elif lengths == "lq_le_lk":
        lq = draw(st.integers(min_len, lk))
    elif lengths == "any":
        lq = draw(st.integers(min_len, max_len))
    else:
        raise ValueError(f"unknown lengths mode {lengths!r}")
    d = draw(st.integers(1, max_dim))
    if value_dim == "same":
        dv = d
    elif value_dim == "any":
        dv = draw(st.one_of(st.just(d), st.integers(1, max_dim)))
    else:
        raise ValueError(f"unknown value_dim mode {value_dim!r}")
    return AttentionShape(b=draw(st.integers(1, max_batch)), h=h, hkv=hkv, lq=lq, lk=lk, d=d, dv=dv)


@st.composite
def qkv(draw: st.DrawFn, shape: AttentionShape, *, requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``(q, k, v)`` of ``shape`` in the backend layout ``(B, H, L, D)``."""
    seed = draw(SEEDS)
    s = shape
    q = randn((s.b, s.h, s.lq, s.d), seed, requires_grad=requires_grad)
    k = randn((s.b, s.hkv, s.lk, s.d), seed + 1, requires_grad=requires_grad)
    v = randn((s.b, s.hkv, s.lk, s.dv), seed + 2, requires_grad=requires_grad)
    return q, k, v


@st.composite
def broadcastable_shapes(draw: st.DrawFn, full: Sequence[int], *, min_dims: int = 2) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: each axis kept or set to 1, and up to ``len(full) - min_dims``
    leading axes dropped (so ``(Lq, Lk)``, ``(H, Lq, Lk)``, ``(B, 1, 1, Lk)``, ... all occur)."""
    dims = [draw(st.sampled_from([n, 1])) for n in full]
    drop = draw(st.integers(0, max(0, len(full) - min_dims)))
    return tuple(dims[drop:])


# ----------------------------------------------------------------------------------------------------------
# Masks (bool, True = may attend, broadcastable to (B, H, Lq, Lk))
# ----------------------------------------------------------------------------------------------------------


@st.composite
def random_bool_masks(draw: st.DrawFn, b: int, h: int, lq: int, lk: int) -> Tensor:
    """A random bool mask of a broadcastable shape; when it has a query axis, some query rows are fully
    masked (the contract says those rows return zeros)."""
    shape = draw(broadcastable_shapes((b, h, lq, lk)))
    mask = rand_bool(shape, draw(SEEDS), draw(st.sampled_from([0.2, 0.5, 0.9, 1.0])))
    if shape[-2] == lq:  # the mask has a query axis (or Lq == 1)
        rows = draw(st.lists(st.integers(0, lq - 1), max_size=lq, unique=True))
        mask[..., rows, :] = False
    return mask


@st.composite
def _sorted_doc_ids(draw: st.DrawFn, b: int, length: int, seed: int) -> Tensor:
    """Packed-sequence document ids ``(B, L)``: non-decreasing, starting at 0."""
    starts = rand_bool((b, length), seed, draw(st.sampled_from([0.1, 0.3, 0.6])))
    starts[:, 0] = False
    return starts.long().cumsum(dim=-1)


def _causal(b: int, lq: int, lk: int) -> st.SearchStrategy[Tensor]:
    return st.just(blocks.causal_mask(lq, lk))


@st.composite
def _sliding_window(draw: st.DrawFn, b: int, lq: int, lk: int) -> Tensor:
    return blocks.sliding_window_mask(lq, lk, window=draw(st.integers(1, lk + 1)))


@st.composite
def _prefix_lm(draw: st.DrawFn, b: int, lq: int, lk: int) -> Tensor:
    if draw(st.booleans()):
        return blocks.prefix_lm_mask(lq, lk, prefix_len=draw(st.integers(0, lk + 1)))
    prefix = torch.tensor(draw(st.lists(st.integers(0, lk + 1), min_size=b, max_size=b)))
    return blocks.prefix_lm_mask(lq, lk, prefix_len=prefix)


@st.composite
def _document(draw: st.DrawFn, b: int, lq: int, lk: int) -> Tensor:
    ids_k = draw(_sorted_doc_ids(b, lk, draw(SEEDS)))
    # Queries are the last Lq positions of the key sequence (as after a cache) or their own sequence.
    ids_q = ids_k[:, lk - lq :] if lq <= lk and draw(st.booleans()) else draw(_sorted_doc_ids(b, lq, draw(SEEDS)))
    return blocks.document_mask(ids_q, ids_k)


@st.composite
def _padding(draw: st.DrawFn, b: int, lq: int, lk: int) -> Tensor:
    # Allow fully padded rows here: a backend must return zeros for them.
    return blocks.padding_mask(rand_bool((b, lk), draw(SEEDS), draw(st.sampled_from([0.3, 0.7, 1.0]))))


#: One strategy per registered mask kind, each ``(b, lq, lk) -> strategy of a mask``. Registering a new mask
#: kind without adding it here fails ``test_every_registered_mask_has_a_strategy``.
MASK_STRATEGIES: dict[str, Callable[[int, int, int], st.SearchStrategy[Tensor]]] = {
    "causal": _causal,
    "document": _document,
    "padding": _padding,
    "prefix_lm": _prefix_lm,
    "sliding_window": _sliding_window,
}


@st.composite
def registered_masks(draw: st.DrawFn, b: int, lq: int, lk: int, kind: str | None = None) -> Tensor:
    """A mask built by a registered mask builder (``kind``, or any registered kind)."""
    kind = draw(st.sampled_from(blocks.names("mask"))) if kind is None else kind
    if kind not in MASK_STRATEGIES:
        raise KeyError(f"mask kind {kind!r} is registered but tests/strategies.py has no strategy for it")
    return draw(MASK_STRATEGIES[kind](b, lq, lk))


@st.composite
def attention_masks(draw: st.DrawFn, b: int, h: int, lq: int, lk: int, *, allow_none: bool = True) -> Tensor | None:
    """None, a random bool mask, a registered-kind mask, or two of those combined with ``&``."""
    options = [random_bool_masks(b, h, lq, lk), registered_masks(b, lq, lk)]
    if allow_none:
        options.insert(0, st.none())
    mask = draw(st.one_of(*options))
    if mask is not None and draw(st.integers(0, 3)) == 0:
        mask = mask & draw(st.one_of(random_bool_masks(b, h, lq, lk), registered_masks(b, lq, lk)))
    return mask


@st.composite
def padding_masks(draw: st.DrawFn, b: int, length: int, *, right_padded: bool = False) -> Tensor:
    """``(B, L)`` bool padding mask, True = real token, with at least one real token per row.

    ``right_padded=True`` gives the usual layout (real tokens first); otherwise real tokens are anywhere.
    """
    if right_padded:
        n_real = draw(st.lists(st.integers(1, length), min_size=b, max_size=b))
        return torch.arange(length)[None, :] < torch.tensor(n_real)[:, None]
    mask = rand_bool((b, length), draw(SEEDS), draw(st.sampled_from([0.3, 0.7, 1.0])))
    first = torch.tensor(draw(st.lists(st.integers(0, length - 1), min_size=b, max_size=b)))
    mask[torch.arange(b), first] = True
    return mask


# ----------------------------------------------------------------------------------------------------------
# Additive biases (float, broadcastable to (B, H, Lq, Lk))
# ----------------------------------------------------------------------------------------------------------


def alibi_bias(b: int, h: int, lq: int, lk: int) -> Tensor:
    """The ALiBi bias ``(B, H, Lq, Lk)`` for queries at the last ``Lq`` of ``max(Lq, Lk)`` positions."""
    k_pos = torch.arange(lk).expand(b, lk)
    q_pos = (torch.arange(lq) + (lk - lq)).expand(b, lq)
    return ALiBiPositionalBias(d_model=h, n_heads=h).attention_bias(q_pos, k_pos)


@st.composite
def attention_biases(draw: st.DrawFn, b: int, h: int, lq: int, lk: int, *, allow_none: bool = True) -> Tensor | None:
    """None, a random additive bias of a broadcastable shape, or an ALiBi bias."""
    kind = draw(st.sampled_from(["none", "random", "alibi"] if allow_none else ["random", "alibi"]))
    if kind == "none":
        return None
    if kind == "alibi":
        return alibi_bias(b, h, lq, lk)
    return randn(draw(broadcastable_shapes((b, h, lq, lk))), draw(SEEDS))


# ----------------------------------------------------------------------------------------------------------
# Registries and model sizes
# ----------------------------------------------------------------------------------------------------------


def registry_names(kind: str) -> st.SearchStrategy[str]:
    """Any registered name of ``kind`` (read when drawn, so late registrations are included)."""
    return st.sampled_from(blocks.names(kind))


@st.composite
def model_dims(draw: st.DrawFn, *, max_heads: int = 4, max_d_head: int = 8, even_d_head: bool = True) -> dict:
    """``{d_model, n_heads, n_kv_heads, d_head}`` with ``d_model = n_heads * d_head`` and ``n_kv_heads | n_heads``.

    ``even_d_head`` keeps ``d_head`` even (rotary needs it).
    """
    n_heads = draw(st.integers(1, max_heads))
    n_kv_heads = draw(st.sampled_from(divisors(n_heads)))
    d_head = draw(st.integers(1, max_d_head // 2)) * 2 if even_d_head else draw(st.integers(1, max_d_head))
    return {"d_model": n_heads * d_head, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "d_head": d_head}


@st.composite
def token_ids(draw: st.DrawFn, vocab_size: int, b: int, length: int) -> Tensor:
    """``(B, L)`` int64 token ids in ``[0, vocab_size)``."""
    gen = torch.Generator().manual_seed(draw(SEEDS))
    return torch.randint(0, vocab_size, (b, length), generator=gen)


#: Valid sampling settings at their extremes: what ``SamplingParams`` accepts, down to a top-p or a temperature that
#: underflows float32 and a repetition penalty that overflows it.
EXTREME_FLOATS = st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.3, 1.0, 7.0, 1e30, 1e300])


@st.composite
def sampling_settings(draw: st.DrawFn) -> dict:
    """Keyword arguments of a valid ``SamplingParams`` that samples, each field drawn from its extremes."""
    return {
        "do_sample": True,
        "temperature": draw(EXTREME_FLOATS),
        "top_k": draw(st.none() | st.sampled_from([1, 2, 10**30])),
        "top_p": draw(st.none() | st.sampled_from([5e-324, 1e-300, 1e-30, 0.5, 1.0])),
        "repetition_penalty": draw(st.none() | EXTREME_FLOATS.filter(lambda x: x <= 1e300)),
        "presence_penalty": draw(st.sampled_from([-2.0, 0.0, 2.0])),
        "frequency_penalty": draw(st.sampled_from([-2.0, 0.0, 2.0])),
    }


@st.composite
def extreme_logits(draw: st.DrawFn, b: int, v: int) -> Tensor:
    """``(B, V)`` float32 logits mixing ordinary values with ``±3e38`` and ``±inf`` (no NaN; every row has a value
    above ``-inf``)."""
    gen = torch.Generator().manual_seed(draw(SEEDS))
    logits = torch.randn(b, v, generator=gen) * draw(st.sampled_from([1.0, 1e3]))
    special = torch.tensor([float("inf"), float("-inf"), 3e38, -3e38, 0.0])
    where = torch.rand(b, v, generator=gen) < draw(st.sampled_from([0.0, 0.2, 0.9]))
    logits = torch.where(where, special[torch.randint(0, 5, (b, v), generator=gen)], logits)
    logits[:, 0] = torch.where(logits[:, 0] == float("-inf"), 0.0, logits[:, 0])
    return logits


# ----------------------------------------------------------------------------------------------------------
# Chat conversations
# ----------------------------------------------------------------------------------------------------------

_CHAT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "2+2=4", "Wie", "geht's?", "你好", "🙂"]


def chat_texts() -> st.SearchStrategy[str]:
    """A message text: a few words, sometimes with surrounding spaces or newlines (which some templates trim)."""
    words = st.lists(st.sampled_from(_CHAT_WORDS), min_size=1, max_size=6).map(" ".join)
    return st.tuples(st.sampled_from(["", " ", "\n"]), words, st.sampled_from(["", " ", "\n"])).map("".join)


@st.composite
def conversations(draw: st.DrawFn, *, system: bool = True, max_turns: int = 3) -> list[dict[str, str]]:
    """A conversation that alternates user and assistant turns, ending with the assistant's, optionally after a
    system message: what a chat SFT file holds."""
    messages = []
    if system and draw(st.booleans()):
        messages.append({"role": "system", "content": draw(chat_texts())})
    for _ in range(draw(st.integers(min_value=1, max_value=max_turns))):
        messages.append({"role": "user", "content": draw(chat_texts())})
        messages.append({"role": "assistant", "content": draw(chat_texts())})
    return messages


# ------------------------------------------------------------------------------------------------ JSON schemas
_NAMES = st.sampled_from(["a", "b", "id", "name", "x_y", "n2"])


def _leaf_schemas() -> st.SearchStrategy[dict]:
    bounded_int = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    ranged_number = st.tuples(st.integers(-10, 10), st.integers(1, 30)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    patterned = st.sampled_from([r"^[a-z]{1,4}$", r"^[0-9]{2}-[A-Z]$", r"^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p})
    short = st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.one_of(st.sampled_from(["red", "green", 'q"uote']), st.integers(-3, 3)), min_size=1,
                    max_size=3, unique=True).map(lambda v: {"enum": v})
    return st.one_of(bounded_int, ranged_number, patterned, short, enum, st.just({"type": "boolean"}),
                     st.just({"type": "null"}))


def json_schemas() -> st.SearchStrategy[dict]:
    """Random JSON schemas whose instances are short: nested objects (some properties required, no others
    allowed), arrays with small bounds, enums, numbers with ranges, strings with patterns or short lengths, and
    ``anyOf`` of them."""
    def extend(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        objects = st.dictionaries(_NAMES, inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req,
                             "additionalProperties": False}))
        arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
        any_of = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
        return st.one_of(objects, arrays, any_of)

    return st.recursive(_leaf_schemas(), extend, max_leaves=6)
