"""Structured outputs: the engine's throughput with a JSON schema on every request against the same requests without
one, and the schema's compile time (first and cached).

    python -m benchmarks.structured                       # the demo-sized and SmolLM2-135M-shaped models
    python -m benchmarks.structured --models demo         # one model
    python -m benchmarks.structured --quick               # a tiny model, few tokens: checks that the script runs

The workload: ``--requests`` prompts (random ids, 16 tokens each) submitted at once to one ``serving.Engine``
(``max_num_seqs`` = the request count), greedy, ``--max-tokens`` new tokens at most, random fp32 weights. The
tokenizer is a byte-level BPE trained on a synthetic corpus to the model's vocabulary size (2,048 for demo,
49,152 for SmolLM2), so the grammar sees a real vocabulary of that size. The constrained run gives every request
``SCHEMA`` (nested objects, an array, enums, bounded numbers, free strings); its rows end when their JSON is
complete or at ``--max-tokens``. Reported per model: the schema's compile time (first: includes building
llguidance's view of the vocabulary; a second distinct schema; cached), output tokens/s of each run (all output
tokens ÷ wall time, after a warm-up of both), their ratio, and the time spent filling and applying the masks per
engine step (``serving.guided.guided_logits``).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

import serving.engine as engine_module
from benchmarks import thin
from models import DecoderLM, DecoderLMConfig
from models.generation import constraints
from models.generation.constraints import Constraint
from serving import Engine, guided
from tokenization import Tokenizer, train_byte_level_bpe

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "home": {"type": "object", "properties": {"city": {"type": "string"}, "lat": {"type": "number"}},
                 "required": ["city"]},
    },
    "required": ["name", "age", "kind", "tags", "home"],
}
OTHER = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["id"]}

MODELS: dict[str, dict[str, Any]] = {
    "demo": dict(DecoderLM.presets["tiny"], vocab_size=2048, d_model=128, n_heads=4, d_ff=512, n_layers=4,
                 max_len=512),
    "smollm2-135m": dict(thin.SHAPES["smollm2-135m"], max_len=512),
    "quick": dict(DecoderLM.presets["tiny"], vocab_size=512, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                  max_len=256),
}


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens trained on seeded pseudo-words and JSON snippets."""
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(max(2000, vocab_size))]
    snippet = ' {"name": "x", "age": 12, "kind": "cat", "tags": ["a"], "home": {"city": "y", "lat": 1.5}}'
    corpus = [" ".join(rng.choice(words) for _ in range(200)) + snippet for _ in range(max(200, vocab_size // 8))]
    return train_byte_level_bpe(corpus, vocab_size=vocab_size, min_frequency=1)


def build(name: str) -> tuple[DecoderLM, Tokenizer]:
    config = dict(MODELS[name])
    tok = synthetic_tokenizer(config["vocab_size"])
    config.update(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.from_dict(config)).eval(), tok


def timed_run(engine: Engine, prompts: list[list[int]], max_tokens: int, constraint: Any) -> tuple[int, float]:
    """(output tokens, seconds) of all ``prompts`` submitted at once."""
    start = time.perf_counter()
    outputs = engine.generate(prompts, max_tokens=max_tokens, constraint=constraint)
    return sum(len(o.token_ids) for o in outputs), time.perf_counter() - start


def measure(name: str, requests: int, max_tokens: int) -> dict[str, float]:
    model, tok = build(name)
    vocab, eos = model.config.vocab_size, tok.eos_token_id
    start = time.perf_counter()
    constraints.compile_constraint(Constraint.json_schema(SCHEMA), tok, vocab, eos)
    first = time.perf_counter() - start
    start = time.perf_counter()
    constraints.compile_constraint(Constraint.json_schema(OTHER), tok, vocab, eos)
    second = time.perf_counter() - start
    start = time.perf_counter()
    constraints.compile_constraint(Constraint.json_schema(SCHEMA), tok, vocab, eos)
    cached = time.perf_counter() - start

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (16,), generator=g).tolist() for _ in range(requests)]
    engine = Engine(model, tok, max_num_seqs=requests)
    schema = Constraint.json_schema(SCHEMA)
    timed_run(engine, prompts[:2], 4, None)  # warm-up of both paths
    timed_run(engine, prompts[:2], 4, schema)

    spent = {"s": 0.0, "steps": 0}
    plain_guided = guided.guided_logits

    def counting(logits: torch.Tensor, scheduled: list) -> torch.Tensor:
        t = time.perf_counter()
        out = plain_guided(logits, scheduled)
        spent["s"] += time.perf_counter() - t
        spent["steps"] += 1
        return out

    free_tokens, free_s = timed_run(engine, prompts, max_tokens, None)
    engine_module.guided_logits = counting
    try:
        spent.update(s=0.0, steps=0)
        json_tokens, json_s = timed_run(engine, prompts, max_tokens, schema)
    finally:
        engine_module.guided_logits = plain_guided
    return {"compile_first_ms": first * 1e3, "compile_second_ms": second * 1e3, "compile_cached_us": cached * 1e6,
            "free_tok_s": free_tokens / free_s, "json_tok_s": json_tokens / json_s,
            "ratio": (json_tokens / json_s) / (free_tokens / free_s), "json_tokens": json_tokens,
            "free_tokens": free_tokens, "mask_ms_per_step": spent["s"] * 1e3 / max(1, spent["steps"])}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["demo", "smollm2-135m"], choices=list(MODELS))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the quick model, 4 requests of 8 tokens")
    args = parser.parse_args(argv)
    for flag in ("requests", "max_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    names, requests, max_tokens = (["quick"], 4, 8) if args.quick else (args.models, args.requests, args.max_tokens)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {requests} concurrent requests, "
          f"<= {max_tokens} new tokens, greedy")
    rows = []
    for name in names:
        row = {"model": name, **measure(name, requests, max_tokens)}
        rows.append(row)
        print(f"{name:14s} compile {row['compile_first_ms']:.1f} ms first (vocabulary included), "
              f"{row['compile_second_ms']:.2f} ms another schema, {row['compile_cached_us']:.0f} us cached | "
              f"free {row['free_tok_s']:.1f} tok/s ({row['free_tokens']} tokens), json {row['json_tok_s']:.1f} tok/s "
              f"({row['json_tokens']} tokens): {row['ratio']:.2f}x | masks {row['mask_ms_per_step']:.2f} ms/step")
    return rows


if __name__ == "__main__":
    main()
