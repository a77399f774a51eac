"""NaN weights never give tokens: every decoding path raises ``ValueError`` on NaN logits it would pick from."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from tests.models.test_kv_cache import build

VOCAB = 32


def decoder(**overrides: object) -> DecoderLM:
    config = dict(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=64, dropout=0.0)
    return build(DecoderLM, DecoderLMConfig(**{**config, **overrides}), 0)


def seq2seq() -> Seq2SeqTransformer:
    config = Seq2SeqConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                           max_len=64, dropout=0.0)
    return build(Seq2SeqTransformer, config, 0)


def poison(model: torch.nn.Module, name: str) -> torch.nn.Module:
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] = float("nan")
    return model


SAMPLE = dict(do_sample=True, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs", [{}, SAMPLE, {"eos_token_id": None}, {"compile": True}],
                         ids=["greedy", "sampled", "no-eos", "compiled"])
def test_nan_weights_raise_in_decoder_generate_and_stream(kwargs: dict, graph_backend: None) -> None:
    model = poison(decoder(), "layers.0.ffn.up_proj.weight")
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"logits of step 0 are NaN in row\(s\) \[0\]"):
        model.generate(prompt, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="NaN"):
        next(model.stream(prompt, max_new_tokens=4, **kwargs))


@pytest.mark.parametrize("poisoned", ["target", "draft"])
@pytest.mark.parametrize("kwargs", [{}, SAMPLE], ids=["greedy", "sampled"])
def test_nan_weights_raise_in_speculative_decoding(poisoned: str, kwargs: dict) -> None:
    target, draft = decoder(), decoder(d_model=8, d_ff=16)
    poison(target if poisoned == "target" else draft, "layers.0.ffn.up_proj.weight")
    message = "logits of step 0 are NaN" if poisoned == "target" else "draft model's next-token logits"
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, draft_model=draft, num_draft_tokens=3, **kwargs)


@pytest.mark.parametrize("kwargs", [{"num_beams": 1}, {"num_beams": 1, **SAMPLE}, {"num_beams": 3},
                                    {"num_beams": 1, "compile": True}, {"num_beams": 3, "compile": True}],
                         ids=["greedy", "sampled", "beams", "compiled", "compiled-beams"])
def test_nan_weights_raise_in_seq2seq_generate(kwargs: dict, graph_backend: None) -> None:
    model = poison(seq2seq(), "encoder_layers.0.ffn.up_proj.weight")
    with pytest.raises(ValueError, match="logits of step 0 are NaN"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("every_step", [True, False], ids=["cpu-check", "folded-check"])
def test_nan_at_a_later_step_raises_before_its_token(every_step: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Untied embeddings: the prompt's logits are finite; the embeddings of the tokens they pick are NaN, so the
    # logits of step 1 are NaN. With the folded check (off the CPU) it is found at the loop's EOS sync.
    from models.generation import steps

    if not every_step:
        monkeypatch.setattr(steps, "NAN_CHECK_EVERY_STEP", ())
    model = decoder(tie_embeddings=False)
    prompt = torch.tensor([[5, 6, 7], [4, 5, 6]])
    first = model.generate(prompt, max_new_tokens=1, eos_token_id=None)[:, -1]
    assert not set(first.tolist()) & set(prompt.flatten().tolist())
    eos = next(t for t in range(4, VOCAB) if t not in first.tolist())
    with torch.no_grad():
        model.embed_tokens.weight[first] = float("nan")
    with pytest.raises(ValueError, match=r"logits of step 1 are NaN in row\(s\) \[0, 1\]"):
        model.generate(prompt, max_new_tokens=5, eos_token_id=eos)
    stream = model.stream(prompt, max_new_tokens=5, eos_token_id=eos)
    assert torch.equal(next(stream), first)
    with pytest.raises(ValueError, match="NaN"):
        list(stream)


@settings(max_examples=60)
@given(st.integers(1, 4), st.integers(1, 40), st.data())
def test_the_fast_nan_checks_agree_with_isnan_any(rows: int, vocab: int, data: st.DataObject) -> None:
    # has_nan / nan_rows use a max reduction (which propagates NaN) instead of a (B, V) isnan mask; infinities of
    # either sign must not read as NaN.
    from models.generation.sampling import has_nan, nan_rows

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    for value in (float("nan"), float("inf"), float("-inf")):
        for _ in range(data.draw(st.integers(0, 3))):
            logits[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, vocab - 1))] = value
    live = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    assert has_nan(logits) == bool(torch.isnan(logits).any())
    assert torch.equal(nan_rows(logits), torch.isnan(logits).any(dim=-1))
    assert torch.equal(nan_rows(logits, live), torch.isnan(logits).any(dim=-1) & live)
