"""Constraints and ``logit_bias`` in the engine: each row of a continuous batch follows its own constraint (or
none) and gets the tokens it gets alone and from ``DecoderLM.generate`` (greedy); preemption, prefix caching,
``n > 1`` samples and stop strings keep every output valid; ``logit_bias`` of -100 bans a token."""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
import torch

from models import DecoderLM
from models.generation.constraints import Constraint
from models.generation.sampling import SamplingParams
from serving.engine import Engine
from tests.models.test_constraints import CORPUS
from tokenization import Tokenizer, train_byte_level_bpe

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "name": {"enum": ["bob", "ann"]}},
          "required": ["id", "name"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-[0-9]{2}"


@pytest.fixture(scope="module")
def lm() -> tuple[DecoderLM, Tokenizer]:
    tok = train_byte_level_bpe(CORPUS, vocab_size=300, min_frequency=1)
    torch.manual_seed(1)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                  max_len=128, eos_token_id=tok.eos_token_id).eval()
    return model, tok


PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42]]
CONSTRAINTS = [Constraint.json_schema(SCHEMA), None, Constraint.regex(REGEX), Constraint.choice(["yes", "no"]), None]
BIASES = [None, None, None, None, {7: -100, 8: 5}]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone_and_from_generate(lm) -> None:
    model, tok = lm
    together = Engine(model, tok, max_num_seqs=8).generate(PROMPTS, max_tokens=30, constraint=CONSTRAINTS,
                                                           logit_bias=BIASES)
    for prompt, constraint, bias, out in zip(PROMPTS, CONSTRAINTS, BIASES, together, strict=True):
        alone = Engine(model, tok, max_num_seqs=1).generate([prompt], max_tokens=30, constraint=constraint,
                                                           logit_bias=bias)[0]
        assert out.token_ids == alone.token_ids
        if bias is None:
            want = model.generate(torch.tensor([prompt]), max_new_tokens=30, constraint=constraint, tokenizer=tok)
            assert out.token_ids == want[0, len(prompt):].tolist()[:len(out.token_ids)]
    assert together[0].finish_reason == "stop" and jsonschema.validate(json.loads(together[0].text), SCHEMA) is None
    assert re.fullmatch(REGEX, together[2].text) and together[3].text in ("yes", "no")
    assert 7 not in together[4].token_ids
    assert together[1].token_ids != together[0].token_ids  # the free twin of row 0 is not constrained


def test_preemption_prefix_caching_and_samples_keep_outputs_valid(lm) -> None:
    model, tok = lm
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 6
    constraints = [Constraint.json_schema(SCHEMA), Constraint.regex(REGEX)] * 3
    roomy = Engine(model, tok, max_num_seqs=8).generate(prompts, max_tokens=40, constraint=constraints)
    tight = Engine(model, tok, block_size=4, num_blocks=18, max_num_batched_tokens=16)
    squeezed = tight.generate(prompts, max_tokens=40, constraint=constraints)
    assert tight.scheduler.preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    sampled = Engine(model, tok).generate(prompts[:2], SamplingParams(do_sample=True, temperature=1.5), n=4, seed=3,
                                          max_tokens=40, constraint=constraints[:2])
    for text, reason in zip(sampled[0].text, sampled[0].finish_reason, strict=True):
        assert reason == "length" or jsonschema.validate(json.loads(text), SCHEMA) is None
    assert all(reason == "length" or re.fullmatch(REGEX, text)
               for text, reason in zip(sampled[1].text, sampled[1].finish_reason, strict=True))
    assert len(set(sampled[1].text)) > 1  # the samples' states are their own


def test_stop_strings_logprobs_and_bad_arguments(lm) -> None:
    model, tok = lm
    engine = Engine(model, tok)
    out = engine.generate([[5, 6]], max_tokens=30, constraint=Constraint.choice(["abc-de", "abc-fg"]), stop="-",
                          logprobs=2)[0]
    assert out.text == "abc" and out.finish_reason == "stop"
    assert all(abs(e.logprob) < float("inf") for e in out.logprobs)  # reported from the unmasked logits
    free = engine.generate([[5, 6]], max_tokens=8)[0].token_ids
    banned = engine.generate([[5, 6]], max_tokens=8, logit_bias={t: -100 for t in free})[0].token_ids
    assert not set(banned) & set(free)
    for kwargs, match in [(dict(logit_bias={"x": 1}), "logit_bias key"),
                          (dict(logit_bias={3: 101}), r"\[-100, 100\]"),
                          (dict(constraint=Constraint.regex("(")), "invalid regex"),
                          (dict(constraint="{}"), "Constraint")]:
        with pytest.raises(ValueError, match=match):
            engine.generate([[5, 6]], max_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(model).generate([[5, 6]], constraint=Constraint.json_object())
    # What crosses the pipe to an engine process (ProcessEngine pickles a request's arguments).
    assert all(pickle.loads(pickle.dumps(c)) == c for c in CONSTRAINTS)
