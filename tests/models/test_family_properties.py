"""The generic properties, run over every family's ``*-tiny`` preset without new test code per family.

A family that registers a ``<family>-tiny`` preset (see ``models/convert/<family>.py``) is picked up here:
causality, padding invariance, agreement of every attention backend with ``math``, KV-cached decoding equal to the
full forward pass, save/load round trip, and a whole-model ``torch.compile`` trace. References are brute force (the
same model on the unpadded sequence, on a perturbed suffix, without a cache) or the ``math`` backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
import models
from models import DecoderLM, EncoderLM, Seq2SeqTransformer
from models.core.stack import new_caches

PRESETS = [
    pytest.param(cls, name, id=f"{cls.__name__}-{name}")
    for cls in (DecoderLM, EncoderLM, Seq2SeqTransformer)
    for name in sorted(cls.presets)
    if name.endswith("tiny")
]
VOCAB = 97
ATOL = 1e-4
SEEDS = st.integers(0, 2**16)
_BUILT: dict[tuple[type, str], torch.nn.Module] = {}


def tiny(cls: type, name: str) -> torch.nn.Module:
    """The preset at a small vocabulary, randomly initialised (norm weights and biases perturbed), in eval mode."""
    key = (cls, name)
    if key not in _BUILT:
        torch.manual_seed(0)
        model = cls.from_preset(name, vocab_size=VOCAB, **_special_ids(cls, name))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        _BUILT[key] = model.eval()
    model = _BUILT[key]
    model.set_attention_backend("sdpa")
    return model


def _special_ids(cls: type, name: str) -> dict[str, int | None]:
    config = cls.presets[name]
    ids = {k: (None if config.get(k) is None else min(config[k], VOCAB - 1))
           for k in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id", "decoder_start_token_id")
           if k in config}
    return ids


def ids_of(seed: int, b: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, length), generator=torch.Generator().manual_seed(seed))


def source(b: int) -> torch.Tensor:
    """A fixed source batch for encoder-decoders (the decoder side is what these properties look at)."""
    return ids_of(999, b, 7)


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(model, Seq2SeqTransformer):
        return model(source(ids.shape[0]), ids, tgt_mask=mask).logits
    return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize(("cls", "name"), PRESETS)
@settings(max_examples=4)
@given(seed=SEEDS, length=st.integers(2, 20), cut=st.integers(1, 19))
@torch.no_grad()
def test_causal_stacks_do_not_look_ahead(cls: type, name: str, seed: int, length: int, cut: int) -> None:
    if cls is EncoderLM:
        pytest.skip("encoders are bidirectional")
    model = tiny(cls, name)
    cut = min(cut, length - 1)
    ids = ids_of(seed, 2, length)
    changed = ids.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % VOCAB
    torch.testing.assert_close(logits(model, changed)[:, :cut], logits(model, ids)[:, :cut], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("cls", "name"), PRESETS)
@settings(max_examples=4)
@given(seed=SEEDS, length=st.integers(1, 16), pad=st.integers(1, 5))
@torch.no_grad()
def test_padding_is_invisible(cls: type, name: str, seed: int, length: int, pad: int) -> None:
    """A padded row gives the logits of the sequence alone (left padding for decoders, right for the others)."""
    model = tiny(cls, name)
    ids = ids_of(seed, 1, length)
    alone = logits(model, ids)
    filler = ids_of(seed + 1, 1, pad)
    left = cls is DecoderLM
    padded = torch.cat([filler, ids] if left else [ids, filler], dim=1)
    mask = torch.ones_like(padded, dtype=torch.bool)
    if left:
        mask[:, :pad] = False
    else:
        mask[:, length:] = False
    if isinstance(model, Seq2SeqTransformer):
        out = model(source(1), padded, tgt_mask=mask).logits
    else:
        out = model(padded, attention_mask=mask).logits
    real = out[:, pad:] if left else out[:, :length]
    torch.testing.assert_close(real, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("cls", "name"), PRESETS)
@pytest.mark.parametrize("backend", [b for b in blocks.names("attention_backend") if b != "math"])
@torch.no_grad()
def test_every_backend_agrees_with_math(cls: type, name: str, backend: str) -> None:
    model = tiny(cls, name)
    ids = ids_of(3, 2, 19)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -4:] = False
    model.set_attention_backend("math")
    expected = logits(model, ids, mask)
    model.set_attention_backend(backend)
    actual = logits(model, ids, mask)
    torch.testing.assert_close(actual[mask], expected[mask], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("cls", "name"), [p for p in PRESETS if p.values[0] is not EncoderLM])
@settings(max_examples=3)
@given(seed=SEEDS, length=st.integers(2, 20), step=st.integers(1, 5))
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(cls: type, name: str, seed: int, length: int, step: int) -> None:
    """Feeding the sequence in chunks through the KV cache gives the full pass's logits (windows included)."""
    model = tiny(cls, name)
    ids = ids_of(seed, 2, length)
    full = logits(model, ids)
    if isinstance(model, Seq2SeqTransformer):
        memory = model.encode(source(2))
        cache = new_caches(len(model.decoder_layers), length, cross=True)
        chunks = [model.decode(memory, ids[:, i:i + step], cache=cache) for i in range(0, length, step)]
    else:
        cache = new_caches(len(model.layers), length)
        chunks = [model(ids[:, i:i + step], cache=cache).logits for i in range(0, length, step)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("cls", "name"), PRESETS)
@torch.no_grad()
def test_save_and_load_round_trip(cls: type, name: str, tmp_path: Path) -> None:
    model = tiny(cls, name)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = models.from_pretrained(tmp_path / "ckpt")
    assert type(loaded) is cls and loaded.config == model.config
    ids = ids_of(5, 2, 9)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize(("cls", "name"), PRESETS)
@torch.no_grad()
def test_whole_model_traces_as_one_graph(cls: type, name: str) -> None:
    torch._dynamo.reset()
    model = tiny(cls, name)
    ids = ids_of(7, 2, 11)
    if isinstance(model, Seq2SeqTransformer):
        run = lambda src, tgt: model(src, tgt).logits  # noqa: E731
        args = (source(2), ids)
    else:
        run = lambda i: model(i).logits  # noqa: E731
        args = (ids,)
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*args), run(*args), atol=ATOL, rtol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize(("cls", "name"), [p for p in PRESETS if p.values[0] is DecoderLM])
@torch.no_grad()
def test_generation_runs_for_every_decoder_family(cls: type, name: str) -> None:
    """KV-cached greedy generation equals greedy decoding by repeated full forward passes."""
    model = tiny(cls, name)
    prompt = ids_of(11, 1, 5)
    out = model.generate(prompt, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, logits(model, seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, seq)
