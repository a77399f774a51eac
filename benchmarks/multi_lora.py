"""Many LoRA adapters in one engine: per-request adapters in the continuous batch against the base model alone, and
against serving the adapters one after another with their weights merged.

    python -m benchmarks.multi_lora                  # demo-sized and GPT-2-shaped models (figures: docs/multi-lora.md)
    python -m benchmarks.multi_lora --models demo    # one model
    python -m benchmarks.multi_lora --quick          # tiny model, few requests: checks that the script runs

The workload (seeded): ``--requests`` prompts (random token ids, lengths uniform in ``--prompt-len``), each asking
for ``--output-len`` tokens greedily (random fp32 weights, no EOS), all queued at once; request ``i`` names adapter
``i % --adapters``. The adapters are LoRAs of ranks spread evenly over ``--ranks`` (8 … 64), alternately on the
attention projections (q, k, v, o) and on every linear layer of the blocks, with random non-zero ``B``.

- **multi-LoRA**: one ``serving.Engine`` with every adapter loaded (``max_loras`` = the adapter count,
  ``max_lora_rank`` = the largest rank), all requests batched together whatever their adapter;
- **base only**: the same requests on an ``Engine`` of the base model without adapters (the ceiling);
- **merged, one after another**: for each adapter in turn, its weights merged into a copy of the base model
  (``W + scale · B A``) and its requests served by an ``Engine`` of that model; the merges are timed too.

Reported: output tokens/s of each and the ratios multi-LoRA / base only and multi-LoRA / merged; the greedy tokens
of multi-LoRA are compared with those of the merged models (float32: equal up to rare near-ties).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from typing import Any

import torch

from blocks.adapters import LoRA
from models import DecoderLM
from serving import Engine

SHAPES = {
    # examples/generate.py's demo model: preset "tiny" at d_model 128, 4 layers, a 2048-token BPE vocabulary.
    "demo": dict(vocab_size=2048, d_model=128, n_heads=4, d_ff=512, n_layers=4, max_len=512),
    "gpt2": dict(DecoderLM.presets["gpt2-small"]),
    "quick": dict(vocab_size=256, d_model=32, n_heads=2, d_ff=64, n_layers=2, max_len=128),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def build(shape: str) -> DecoderLM:
    """A randomly initialised float32 model of ``shape`` (the GPT-2 preset, or the tiny preset at that size)."""
    torch.manual_seed(0)
    preset = "gpt2-small" if shape == "gpt2" else "tiny"
    overrides = {} if shape == "gpt2" else SHAPES[shape]
    return DecoderLM.from_preset(preset, **overrides, dropout=0.0, eos_token_id=None).eval()


def make_adapters(model: DecoderLM, count: int, ranks: tuple[int, int], seed: int = 0) -> dict[str, dict[str, LoRA]]:
    """``count`` LoRAs (layer name -> ``LoRA``) with ranks spread over ``ranks``, alternately on the attention
    projections and on every linear layer of the blocks, ``B`` random (an untrained LoRA would change nothing)."""
    from blocks.multi_lora import lora_layers

    g = torch.Generator().manual_seed(seed)
    layers = dict(model.named_modules())
    out = {}
    for i in range(count):
        r = round(ranks[0] + (ranks[1] - ranks[0]) * i / max(1, count - 1))
        names = [n for n in lora_layers(model) if i % 2 or n.endswith(ATTENTION)]
        adapter = {}
        for name in names:
            layer = layers[name]
            lora = LoRA(layer.in_features, layer.out_features, r=r, alpha=2 * r)
            with torch.no_grad():
                lora.lora_A.normal_(0, 0.02, generator=g)
                lora.lora_B.normal_(0, 0.02, generator=g)
            adapter[name] = lora
        out[f"lora{i}-r{r}"] = adapter
    return out


def merged_copy(model: DecoderLM, adapter: dict[str, LoRA]) -> DecoderLM:
    """A copy of ``model`` with ``W + scale · B A`` in each adapted layer."""
    copy = build_like(model)
    with torch.no_grad():
        for name, lora in adapter.items():
            copy.get_submodule(name).weight += lora.delta_weight()
    return copy


def build_like(model: DecoderLM) -> DecoderLM:
    copy = DecoderLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def timed(engine: Engine, prompts: list[list[int]], output_len: int, adapters: list[Any] | None = None) -> tuple[
        float, list[list[int]]]:
    """Seconds to serve ``prompts`` (all queued at once) and their tokens."""
    start = time.perf_counter()
    outputs = engine.generate(prompts, max_tokens=output_len, adapter=adapters)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def run(shape: str, args: argparse.Namespace) -> dict[str, float]:
    model = build(shape)
    adapters = make_adapters(model, args.adapters, tuple(args.ranks))
    names = list(adapters)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    chosen = [names[i % len(names)] for i in range(args.requests)]
    limits = dict(max_num_seqs=args.requests, max_num_batched_tokens=512)
    warm = [prompts[0][:4]]

    base = Engine(build_like(model), **limits)
    base.generate(warm, max_tokens=2)
    base_s, _ = timed(base, prompts, args.output_len)

    multi = Engine(build_like(model), **limits, max_loras=len(names), max_lora_rank=max(args.ranks))
    for name, adapter in adapters.items():
        multi.add_lora(name, adapter)
    multi.generate(warm, max_tokens=2, adapter=names[0])
    multi_s, multi_tokens = timed(multi, prompts, args.output_len, chosen)

    merged_s, mismatched = 0.0, 0
    for name, adapter in adapters.items():
        start = time.perf_counter()
        engine = Engine(merged_copy(model, adapter), **limits)
        merge_s = time.perf_counter() - start
        mine = [i for i, c in enumerate(chosen) if c == name]
        seconds, tokens = timed(engine, [prompts[i] for i in mine], args.output_len)
        merged_s += merge_s + seconds
        mismatched += sum(tokens[j] != multi_tokens[i] for j, i in enumerate(mine))

    total = args.requests * args.output_len
    row = {"base_tok_s": total / base_s, "multi_tok_s": total / multi_s, "merged_tok_s": total / merged_s}
    row["vs_base"] = row["multi_tok_s"] / row["base_tok_s"]
    row["vs_merged"] = row["multi_tok_s"] / row["merged_tok_s"]
    row["mismatched"] = mismatched
    return row


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["demo", "gpt2"], default=["demo", "gpt2"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs=2, default=[8, 64], metavar=("LOW", "HIGH"))
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("LOW", "HIGH"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a tiny model and 8 requests over 2 adapters")
    args = p.parse_args(argv)
    for flag in ("requests", "adapters", "output_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.ranks[0] <= args.ranks[1] or not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error(f"--ranks and --prompt-len take LOW <= HIGH, both >= 1; got {args.ranks} and {args.prompt_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models
    if args.quick:
        models, args.requests, args.adapters, args.ranks, args.output_len = ["quick"], 8, 2, [2, 8], 4
        args.prompt_len = [4, 12]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.requests} requests over {args.adapters} adapters "
          f"(rank {args.ranks[0]}-{args.ranks[1]}), prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.output_len} new tokens each")
    print("| model | base only tok/s | multi-LoRA tok/s | merged one after another tok/s | multi / base | "
          "multi / merged | tokens differing from merged |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for shape in models:
        row = rows[shape] = run(shape, args)
        print(f"| {shape} | {row['base_tok_s']:.0f} | {row['multi_tok_s']:.0f} | {row['merged_tok_s']:.0f} | "
              f"{row['vs_base']:.2f}x | {row['vs_merged']:.2f}x | {row['mismatched']} of {args.requests} requests |",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
