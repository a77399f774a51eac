"""Constrained decoding (``models.generation.constraints``) in ``DecoderLM.generate`` / ``stream``: a tiny random
model's constrained output always validates (``jsonschema``) or fullmatches (``re``), or stops at
``max_new_tokens``; the mask keeps allowed logits exactly and bans the rest (checked token by token against the
grammar); compiled decoding masks without recompiling."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from models import DecoderLM
from models.generation import constraints
from models.generation.constraints import (
    Constraint,
    RowConstraints,
    allowed_tokens,
    apply_bitmask,
    compile_constraint,
    fill_bitmasks,
    new_bitmask,
)
from models.generation.sampling import SamplingParams
from tests.strategies import json_schemas
from tokenization import Tokenizer, train_byte_level_bpe

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = ['{"name": "bob", "id": 12, "a": [true, false, null], "x_y": -3.5}', "yes no red green 42-Z abc"] * 4


@pytest.fixture(scope="module")
def lm() -> tuple[DecoderLM, Tokenizer]:
    tok = train_byte_level_bpe(CORPUS, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok) + 4, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                  max_len=256, eos_token_id=tok.eos_token_id).eval()
    return model, tok


def new_tokens(model: DecoderLM, out: torch.Tensor, prompt_len: int, tok: Tokenizer) -> list[tuple[str, bool]]:
    """Each row's text and whether it ended with EOS."""
    rows = []
    for ids in out[:, prompt_len:].tolist():
        ended = tok.eos_token_id in ids
        rows.append((tok.decode(ids[:ids.index(tok.eos_token_id)] if ended else ids), ended))
    return rows


@settings(max_examples=8)
@given(schema=json_schemas(), seed=st.integers(0, 2**16))
def test_random_schemas_always_validate_or_stop_at_max_new_tokens(lm, schema: dict, seed: int) -> None:
    model, tok = lm
    prompt = torch.tensor([[5, 6, 7]] * 3)
    out = model.generate(prompt, max_new_tokens=48, constraint=Constraint.json_schema(schema), tokenizer=tok,
                         sampling=SamplingParams(do_sample=True, temperature=1.3),
                         generator=torch.Generator().manual_seed(seed))
    for text, ended in new_tokens(model, out, 3, tok):
        if ended:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert out.shape[1] == 3 + 48  # unfinished only when it ran out of tokens


@settings(max_examples=5)
@given(pattern=st.sampled_from([r"[a-c]{2,5}-[0-9]{3}", r"(yes|no|maybe)!?", r"[a-z_]+@[a-z]+\.(com|org)",
                                 r"-?[0-9]+(\.[0-9][0-9])?"]),
       seed=st.integers(0, 2**16))
def test_regex_outputs_fullmatch(lm, pattern: str, seed: int) -> None:
    model, tok = lm
    for stream in (False, True):
        kwargs = dict(max_new_tokens=40, constraint=Constraint.regex(pattern), tokenizer=tok, do_sample=True,
                      generator=torch.Generator().manual_seed(seed))
        prompt = torch.tensor([[9, 10], [11, 12]])
        if stream:
            out = torch.cat([prompt, torch.stack(list(model.stream(prompt, **kwargs)), dim=1)], dim=1)
        else:
            out = model.generate(prompt, **kwargs)
        for text, ended in new_tokens(model, out, 2, tok):
            assert not ended or re.fullmatch(pattern, text), (pattern, text)


def test_choice_grammar_and_json_object(lm) -> None:
    model, tok = lm
    prompt = torch.tensor([[5, 6]])
    options = ['say "hi"', "no\\way", "maybe"]
    for seed in range(4):
        out = model.generate(prompt, max_new_tokens=30, constraint=Constraint.choice(options), tokenizer=tok,
                             do_sample=True, generator=torch.Generator().manual_seed(seed))
        assert new_tokens(model, out, 2, tok)[0] in [(o, True) for o in options]
    gbnf = 'root ::= "(" [0-9] [0-9]? ")"'
    out = model.generate(prompt, max_new_tokens=30, constraint=Constraint.grammar(gbnf), tokenizer=tok)
    text, ended = new_tokens(model, out, 2, tok)[0]
    assert ended and re.fullmatch(r"\(\d+\)", text)
    out = model.generate(prompt, max_new_tokens=80, constraint=Constraint.json_object(), tokenizer=tok,
                         repetition_penalty=1.3, do_sample=True, generator=torch.Generator().manual_seed(0))
    text, ended = new_tokens(model, out, 2, tok)[0]
    assert text.startswith("{") and (not ended or isinstance(json.loads(text), dict))


def test_mask_keeps_allowed_logits_and_bans_exactly_what_the_grammar_refuses(lm) -> None:
    model, tok = lm
    vocab = model.config.vocab_size
    state = compile_constraint(Constraint.regex(r"[ab]+c"), tok, vocab, tok.eos_token_id).start()
    for token in tok.encode("ab", add_special_tokens=False):
        state.advance(token)
    bitmask = new_bitmask(1, vocab)
    state.fill(bitmask)
    allowed = allowed_tokens(bitmask, vocab)[0]
    # Brute force: a token is allowed exactly when the grammar accepts it as the next token.
    assert allowed.tolist() == [state.allows([t]) == 1 for t in range(vocab)]
    assert allowed[tok.eos_token_id].item() is False and 0 < int(allowed.sum()) < vocab
    logits = torch.randn(1, vocab)
    masked = apply_bitmask(logits, bitmask)
    assert torch.equal(masked[0, allowed], logits[0, allowed]) and bool((masked[0, ~allowed] == float("-inf")).all())


def test_rows_with_and_without_constraints_and_bad_arguments(lm) -> None:
    model, tok = lm
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    free = model.generate(prompt, max_new_tokens=12)
    mixed = model.generate(prompt, max_new_tokens=12, constraint=[None, Constraint.regex("[0-9]{3}")], tokenizer=tok)
    assert torch.equal(mixed[0], free[0])  # the free row is untouched
    assert new_tokens(model, mixed[1:], 3, tok)[0][0].isdigit()
    with pytest.raises(ValueError, match="invalid regex"):
        model.generate(prompt, constraint=Constraint.regex("a("), tokenizer=tok)
    with pytest.raises(ValueError, match="invalid json_schema"):
        model.generate(prompt, constraint=Constraint.json_schema({"type": "nonsense"}), tokenizer=tok)
    with pytest.raises(ValueError, match="2 rows"):
        model.generate(prompt, constraint=[None], tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(prompt, constraint=Constraint.json_object())
    with pytest.raises(ValueError, match="choice"):
        Constraint.choice([])


def test_compiled_generate_masks_without_recompiling(lm, graph_backend: None) -> None:
    model, tok = lm
    prompt = torch.tensor([[5, 6, 7]])
    eager = model.generate(prompt, max_new_tokens=20, constraint=Constraint.regex("[a-z]{3,9}"), tokenizer=tok)
    plain = model.generate(prompt, max_new_tokens=20, compile=True)
    frames = counters["frames"]["total"]
    compiled = model.generate(prompt, max_new_tokens=20, compile=True, constraint=Constraint.regex("[a-z]{3,9}"),
                              tokenizer=tok)
    again = model.generate(prompt, max_new_tokens=20, compile=True, constraint=Constraint.json_object(), tokenizer=tok)
    assert counters["frames"]["total"] == frames  # the constraint is applied outside the graph: nothing recompiles
    assert torch.equal(compiled, eager) and not torch.equal(compiled, plain[:, :compiled.shape[1]])
    assert tok.decode(again[0, 3:].tolist()).startswith("{")


def test_compiled_constraints_are_cached(lm) -> None:
    model, tok = lm
    c = Constraint.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
    first = compile_constraint(c, tok, model.config.vocab_size, tok.eos_token_id)
    assert compile_constraint(Constraint.json_schema(json.loads(c.value)), tok, model.config.vocab_size,
                              tok.eos_token_id) is first
    rows = RowConstraints([first.start(), None], model.config.vocab_size)
    masked = rows.mask(torch.zeros(2, model.config.vocab_size))
    assert bool(torch.isinf(masked[0]).any()) and not bool(torch.isinf(masked[1]).any())


def test_the_thread_pool_fills_the_same_masks_as_one_row_at_a_time(lm, monkeypatch) -> None:
    model, tok = lm
    vocab = model.config.vocab_size
    compiled = compile_constraint(Constraint.regex(r"[a-c]{2,5}-[0-9]{3}"), tok, vocab, tok.eos_token_id)
    states = [compiled.start() for _ in range(4)]
    for i, text in enumerate(["", "ab", "abc-", "abc-12"]):
        for token in tok.encode(text, add_special_tokens=False):
            states[i].advance(token)
    serial, pooled = new_bitmask(5, vocab), new_bitmask(5, vocab)
    fill_bitmasks([*states, None], serial)
    monkeypatch.setattr(constraints, "PARALLEL_ROWS", 2)
    monkeypatch.setattr(constraints, "PARALLEL_CPUS", 1)
    fill_bitmasks([*states, None], pooled)
    assert torch.equal(serial, pooled) and bool((pooled[4] == -1).all())  # the free row stays all-allowed
    assert len({tuple(row.tolist()) for row in pooled[:4]}) == 4


@pytest.mark.parametrize("compile_draft", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_speculative_decoding_checks_draft_tokens_against_the_constraint(lm, compile_draft: bool,
                                                                          graph_backend: None) -> None:
    model, tok = lm
    torch.manual_seed(5)
    draft = DecoderLM.from_preset("tiny", vocab_size=model.config.vocab_size, d_model=32, n_heads=4, n_layers=1,
                                  d_ff=64, max_len=256, eos_token_id=tok.eos_token_id).eval()
    with torch.no_grad():  # a draft that agrees with the target often, but not always
        draft.embed_tokens.weight.copy_(model.embed_tokens.weight)
        draft.lm_head.weight.copy_(model.lm_head.weight)
    prompt = torch.tensor([[5, 6, 7]])
    schema = {"type": "array", "items": {"enum": ["red", "green", 7]}, "minItems": 2, "maxItems": 6}
    for c in (Constraint.json_schema(schema), Constraint.regex(r"[a-c]{2,9}-[0-9]{1,3}")):
        plain = model.generate(prompt, max_new_tokens=40, constraint=c, tokenizer=tok)
        for k in (1, 3, 5):
            fast = model.generate(prompt, max_new_tokens=40, constraint=c, tokenizer=tok, draft_model=draft,
                                  num_draft_tokens=k, compile=compile_draft)
            assert torch.equal(fast, plain)  # greedy: identical, rejected proposals rolled back
        for seed in range(3):
            out = model.generate(prompt, max_new_tokens=40, constraint=c, tokenizer=tok, draft_model=draft,
                                 num_draft_tokens=3, do_sample=True, generator=torch.Generator().manual_seed(seed))
            text, ended = new_tokens(model, out, 3, tok)[0]
            assert ended
            if c.kind == "regex":
                assert re.fullmatch(c.value, text)
            else:
                jsonschema.validate(json.loads(text), schema)
