"""KV caches in incremental decoding: cached steps reproduce a full forward pass for every positional kind and
attention backend, and generation never recomputes past positions or the cross-attention keys/values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
import models.core.stack
from models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from models.core.stack import new_caches
from tests.strategies import SEEDS, model_dims, padding_masks, registry_names, token_ids

VOCAB = 40
POSITIONALS = blocks.names("positional")
BACKENDS = blocks.names("attention_backend")
#: Backends whose eager CPU path costs tens of milliseconds per call (flex attention is meant to be compiled).
SLOW_ON_CPU = {"flex"}


# ------------------------------------------------------------------------------------------------- strategies
@st.composite
def decoder_configs(
    draw: st.DrawFn,
    positional: str | None = None,
    backend: str | None = None,
    vocab_size: int = VOCAB,
    fast_on_cpu: bool = False,
) -> DecoderLMConfig:
    """A tiny ``DecoderLMConfig`` with its blocks drawn from the registries (``positional``/``backend`` fixed
    when given; ``fast_on_cpu`` leaves out the backends in ``SLOW_ON_CPU``)."""
    return DecoderLMConfig(
        vocab_size=vocab_size,
        n_layers=draw(st.integers(1, 2)),
        d_ff=draw(st.sampled_from([16, 32])),
        max_len=32,
        dropout=0.0,
        positional=positional or draw(registry_names("positional")),
        attention_backend=backend or draw(backends(fast_on_cpu)),
        ffn=draw(registry_names("ffn")),
        norm=draw(registry_names("norm")),
        sublayer=draw(registry_names("sublayer")),
        **draw(model_dims(max_heads=4, max_d_head=8)),
    )


@st.composite
def seq2seq_configs(
    draw: st.DrawFn,
    positional: str | None = None,
    backend: str | None = None,
    vocab_size: int = VOCAB,
    fast_on_cpu: bool = False,
) -> Seq2SeqConfig:
    """A tiny ``Seq2SeqConfig`` with its blocks drawn from the registries."""
    return Seq2SeqConfig(
        vocab_size=vocab_size,
        n_encoder_layers=draw(st.integers(1, 2)),
        n_decoder_layers=draw(st.integers(1, 2)),
        d_ff=draw(st.sampled_from([16, 32])),
        max_len=32,
        dropout=0.0,
        positional=positional or draw(registry_names("positional")),
        attention_backend=backend or draw(backends(fast_on_cpu)),
        ffn=draw(registry_names("ffn")),
        norm=draw(registry_names("norm")),
        sublayer=draw(registry_names("sublayer")),
        share_embeddings=draw(st.booleans()),
        embedding_norm=draw(st.booleans()),
        output_bias=draw(st.booleans()),
        **draw(model_dims(max_heads=4, max_d_head=8)),
    )


def backends(fast_on_cpu: bool = False) -> st.SearchStrategy[str]:
    """Any registered attention backend (``fast_on_cpu``: except those in ``SLOW_ON_CPU``)."""
    if not fast_on_cpu:
        return registry_names("attention_backend")
    return st.sampled_from([name for name in blocks.names("attention_backend") if name not in SLOW_ON_CPU])


def examples(backend: str) -> int:
    """Hypothesis examples per (positional, backend) pair: one for backends that are slow on CPU."""
    return 1 if backend in SLOW_ON_CPU else 3


def build(model_class: type, config: object, seed: int) -> torch.nn.Module:
    """The model with weights drawn from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    return model_class(config).eval()


@st.composite
def left_padding_masks(draw: st.DrawFn, b: int, length: int) -> torch.Tensor:
    """``(B, L)`` bool, each row ``n >= 1`` real tokens at the end (prompts padded on the left)."""
    n_real = torch.tensor(draw(st.lists(st.integers(1, length), min_size=b, max_size=b)))
    return torch.arange(length)[None, :] >= length - n_real[:, None]


@st.composite
def chunk_bounds(draw: st.DrawFn, length: int) -> list[int]:
    """Increasing end points ``0 < e_1 < ... < e_n = length``: a prefill then chunks (often single tokens)."""
    cuts = draw(st.sets(st.integers(1, length - 1))) if length > 1 else set()
    return [*sorted(cuts), length]


# ------------------------------------------------------------------------------------------------- DecoderLM
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_decoder_cached_steps_match_full_forward(positional: str, backend: str) -> None:
    @settings(max_examples=examples(backend))
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        model = build(DecoderLM, data.draw(decoder_configs(positional, backend)), data.draw(SEEDS))
        b, length = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 7))
        ids = data.draw(token_ids(VOCAB, b, length))
        mask = data.draw(st.one_of(st.none(), left_padding_masks(b, length)))
        with torch.no_grad():
            full = model(ids, attention_mask=mask).logits
            cache = new_caches(model.config.n_layers, length)
            pieces, start = [], 0
            for end in data.draw(chunk_bounds(length)):
                step_mask = None if mask is None else mask[:, :end]  # with a cache: past + new tokens
                pieces.append(model(ids[:, start:end], attention_mask=step_mask, cache=cache).logits)
                start = end
        cached = torch.cat(pieces, dim=1)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
        torch.testing.assert_close(cached[real], full[real], atol=1e-5, rtol=0)

    check()


# ------------------------------------------------------------------------------------------------- Seq2Seq
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_seq2seq_cached_steps_match_full_forward(positional: str, backend: str) -> None:
    @settings(max_examples=examples(backend))
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        model = build(Seq2SeqTransformer, data.draw(seq2seq_configs(positional, backend)), data.draw(SEEDS))
        b, src_len = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
        tgt_len = data.draw(st.integers(2, 6))
        src = data.draw(token_ids(VOCAB, b, src_len))
        src_mask = data.draw(st.one_of(st.none(), padding_masks(b, src_len)))
        tgt = data.draw(token_ids(VOCAB, b, tgt_len))
        with torch.no_grad():
            full = model(src, tgt, src_mask).logits
            memory = model.encode(src, src_mask)
            cache = new_caches(model.config.n_decoder_layers, tgt_len, cross=True)
            pieces, start = [], 0
            for end in data.draw(chunk_bounds(tgt_len)):
                pieces.append(model.decode(memory, tgt[:, start:end], src_mask, cache=cache))
                start = end
        # Configs without a norm (norm="identity") give logits in the hundreds: fp32 rounding scales with them.
        scale = float(full.abs().max().clamp_min(1.0))
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5 * scale, rtol=0)

    check()


# ------------------------------------------------------------------------------------------------- no recomputation
def _count_rows(module: torch.nn.Module, counts: list[int]) -> torch.utils.hooks.RemovableHandle:
    """Record, per call of ``module``, how many positions (dim 1 of the input) it processed."""
    return module.register_forward_hook(lambda _m, args, _out: counts.append(args[0].shape[1]))


def test_decoder_generate_preallocates_and_feeds_each_position_once(monkeypatch: pytest.MonkeyPatch) -> None:
    config = DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=32, dropout=0.0)
    model = build(DecoderLM, config, 0)
    made: list[list] = []

    def recording_new_caches(*args, **kwargs):
        made.append(new_caches(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(models.core.stack, "new_caches", recording_new_caches)
    counts: list[int] = []
    projected: list[int] = []
    handles = [_count_rows(model.layers[0].self_attn.k_proj, counts), _count_rows(model.lm_head, projected)]
    prompt = torch.randint(4, VOCAB, (2, 5))
    out = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    for handle in handles:
        handle.remove()
    assert out.shape == (2, 11)
    # The prompt once, then one new position per step; the last token is never fed back.
    assert counts == [5, 1, 1, 1, 1, 1]
    # Only the last prompt position goes through the vocabulary projection.
    assert projected == [1] * 6
    assert not model.final_norm._forward_hooks  # the prefill's hook is gone
    (cache,) = made
    assert len(cache) == config.n_layers
    assert all(c.self_attn.max_len == 5 + 6 for c in cache)
    assert cache[0].self_attn.length == 10


@pytest.mark.parametrize("num_beams", [1, 3])
def test_seq2seq_generate_encodes_once_and_computes_cross_attention_once(num_beams: int) -> None:
    config = Seq2SeqConfig(
        vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2, max_len=32,
        dropout=0.0,
    )
    model = build(Seq2SeqTransformer, config, 0)
    encoder_calls: list[int] = []
    cross_calls: list[list[int]] = [[] for _ in model.decoder_layers]
    self_calls: list[int] = []
    handles = [_count_rows(model.encoder_layers[0], encoder_calls), _count_rows(
        model.decoder_layers[0].self_attn.k_proj, self_calls)]
    for layer, calls in zip(model.decoder_layers, cross_calls, strict=True):
        handles.append(layer.cross_attn.k_proj.register_forward_hook(
            lambda _m, args, _out, calls=calls: calls.append(args[0].shape[0])))
    src = torch.randint(4, VOCAB, (2, 6))
    out = model.generate(src, max_new_tokens=5, num_beams=num_beams, eos_token_id=None)
    for h in handles:
        h.remove()
    assert out.shape == (2, 6)
    assert encoder_calls == [6]
    # One cross-attention key projection per layer for the whole generation, over one row per source.
    assert cross_calls == [[2], [2]]
    assert self_calls == [1] * 5
