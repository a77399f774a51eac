"""Many LoRA adapters in one engine: per-request adapters in the continuous batch against the base model alone, and
against serving the adapters one after another with their weights merged.

    python -m benchmarks.multi_lora                  # demo-sized and GPT-2-shaped models (figures: docs/multi-lora.md)
    python -m benchmarks.multi_lora --models demo    # one model
    python -m benchmarks.multi_lora --clock cpu --threads 1   # on a machine other jobs share: CPU time, one thread
    python -m benchmarks.multi_lora --kernels        # the per-layer products alone: each way of computing them
    python -m benchmarks.multi_lora --quick          # tiny model, few requests: checks that the script runs

The workload (seeded): ``--requests`` prompts (random token ids, lengths uniform in ``--prompt-len``), each asking
for ``--output-len`` tokens greedily (random fp32 weights, no EOS), all queued at once; request ``i`` names adapter
``i % --adapters``. The adapters are LoRAs of ranks spread evenly over ``--ranks`` (8 … 64), alternately on the
attention projections (q, k, v, o) and on every linear layer of the blocks, with random non-zero ``B``.

- **multi-LoRA**: one ``serving.Engine`` with every adapter loaded (``max_loras`` = the adapter count,
  ``max_lora_rank`` = the largest rank), all requests batched together whatever their adapter;
- **multi-LoRA, first op**: the same engine running the layers' updates by the first form of the op
  (``blocks.lora_kernels.grouped_lora``: per-slot products dispatched as a custom op, a new output per layer) — the
  figure before the batched products, measured in the same process;
- **base only**: the same requests on an ``Engine`` of the base model without adapters (the ceiling);
- **merged, one after another**: one copy of the base model; for each adapter in turn, its weights merged into
  that model in place (``W += scale · B A``), its requests served by a fresh ``Engine`` of it (the same limits as
  the others: a step holds all 8 of them; fresh, since the last engine's prefix cache holds the last adapter's
  keys), then the base weights copied back; the merge, the engine's start and the copy back are timed too.

Reported: output tokens/s of each; the ratios multi-LoRA / base only and multi-LoRA / merged; and base only /
merged, the bound on multi-LoRA / merged (what it would be if the adapters cost nothing); the greedy tokens
of multi-LoRA are compared with those of the merged models (float32: equal up to rare near-ties). ``--clock cpu``
counts the process's CPU seconds instead of wall-clock ones: on a machine other jobs share, wall time measures the
other jobs; CPU time (with ``--threads 1``) does not, though their use of the caches still shows.

``--kernels`` times one layer's update alone (CPU time per call, the layers of the model cycled so their weights are
not all in cache) for a decoding step (64 tokens, 8 per adapter) and a prefill step (512 tokens, uneven), by: the
first op; the segmented products (``grouped``); the batched products (``padded``); what ``auto`` picks; and the
rank-concatenated form with a row mask (``((x A_cat) * M) B_cat``, every token times every adapter), left out of
the library.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from typing import Any

import torch

from blocks.adapters import LoRA
from blocks.lora_kernels import KERNELS, add_slot_lora_, grouped_lora
from blocks.multi_lora import LoRARouting, LoRASlots, lora_layers
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


def merge_into(model: DecoderLM, adapter: dict[str, LoRA]) -> None:
    """Add ``scale · B A`` to the weight of each layer ``adapter`` adapts, in place."""
    with torch.no_grad():
        for name, lora in adapter.items():
            model.get_submodule(name).weight.add_(lora.delta_weight())


def unmerge(model: DecoderLM, adapter: dict[str, LoRA], original: dict[str, torch.Tensor]) -> None:
    """Put back the base weights of the layers ``adapter`` adapted (a copy: no rounding left behind)."""
    with torch.no_grad():
        for name in adapter:
            model.get_submodule(name).weight.copy_(original[name])


def build_like(model: DecoderLM) -> DecoderLM:
    copy = DecoderLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(engine: Engine, prompts: list[list[int]], output_len: int, adapters: list[Any] | None = None,
          clock: str = "wall") -> tuple[float, list[list[int]]]:
    """Seconds (of ``clock``) to serve ``prompts`` (all queued at once) and their tokens."""
    now = CLOCKS[clock]
    start = now()
    outputs = engine.generate(prompts, max_tokens=output_len, adapter=adapters)
    return now() - start, [o.token_ids for o in outputs]


class FirstOp:
    """The first form of a slot bank's hook, for comparison: ``grouped_lora`` (a custom op called in eager steps too)
    on contiguous ``(S, R, in)`` / ``(S, out, R)`` copies of the bank's slots, a new output tensor per layer."""

    def __init__(self, bank: LoRASlots) -> None:
        self.bank, self.a, self.b = bank, bank.a.contiguous(), bank.b.contiguous()

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x, routing = args[0], self.bank.routing
        y = grouped_lora(output.reshape(-1, output.shape[-1]), x.reshape(-1, x.shape[-1]), self.a, self.b,
                         self.bank.ranks, routing.order, routing.offsets)
        return y.reshape(output.shape)


def use_first_op(engine: Engine) -> None:
    """Swap ``engine``'s slot hooks for ``FirstOp`` (every adapter must be resident: the copies are taken now)."""
    registry = engine.loras
    for handle in registry.handles:
        handle.remove()
    registry.handles = [engine.model.get_submodule(name).register_forward_hook(FirstOp(bank))
                        for name, bank in registry.banks.items()]


def run(shape: str, args: argparse.Namespace) -> dict[str, float]:
    model = build(shape)
    adapters = make_adapters(model, args.adapters, tuple(args.ranks))
    names = list(adapters)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    chosen = [names[i % len(names)] for i in range(args.requests)]
    limits = dict(max_num_seqs=args.requests, max_num_batched_tokens=512)

    base = Engine(build_like(model), **limits)
    base.generate([prompts[0][:4]], max_tokens=2)
    base_s, _ = timed(base, prompts, args.output_len, clock=args.clock)

    seconds = {}
    for variant in ("multi", "first_op"):
        multi = Engine(build_like(model), **limits, max_loras=len(names), max_lora_rank=max(args.ranks))
        for name, adapter in adapters.items():
            multi.add_lora(name, adapter)
        multi.generate([prompts[0][:4]] * len(names), max_tokens=2, adapter=names)  # every adapter resident
        if variant == "first_op":
            use_first_op(multi)
        seconds[variant], tokens = timed(multi, prompts, args.output_len, chosen, clock=args.clock)
        if variant == "multi":
            multi_tokens = tokens
        first_op_mismatched = sum(t != m for t, m in zip(tokens, multi_tokens, strict=True))

    merged_s, mismatched = 0.0, 0
    now = CLOCKS[args.clock]
    served = build_like(model)  # one model, merged into in place adapter by adapter (as a server would)
    original = {name: served.get_submodule(name).weight.detach().clone() for name in lora_layers(served)}
    for name, adapter in adapters.items():
        start = now()
        merge_into(served, adapter)
        engine = Engine(served, **limits)  # a fresh engine: the last one's prefix cache holds the last adapter
        merge_s = now() - start
        mine = [i for i, c in enumerate(chosen) if c == name]
        took, tokens = timed(engine, [prompts[i] for i in mine], args.output_len, clock=args.clock)
        start = now()
        unmerge(served, adapter, original)
        merged_s += merge_s + took + now() - start
        mismatched += sum(tokens[j] != multi_tokens[i] for j, i in enumerate(mine))

    total = args.requests * args.output_len
    row = {"base_tok_s": total / base_s, "multi_tok_s": total / seconds["multi"],
           "first_op_tok_s": total / seconds["first_op"], "merged_tok_s": total / merged_s}
    row["vs_base"] = row["multi_tok_s"] / row["base_tok_s"]
    row["first_op_vs_base"] = row["first_op_tok_s"] / row["base_tok_s"]
    row["vs_merged"] = row["multi_tok_s"] / row["merged_tok_s"]
    row["bound"] = row["base_tok_s"] / row["merged_tok_s"]  # multi / merged if the adapters cost nothing
    row["mismatched"] = mismatched + first_op_mismatched
    return row


def mask_concat(x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rank-concatenated form: every token through every slot's ``A``, a row mask keeping its own slot's
    columns (scaled), every slot's ``B``: ``((x A_cat) * M) B_cat`` — no gather, but ``S`` times the products."""
    return torch.mm(torch.mm(x, a_cat) * mask, b_cat)


def kernel_table(shape: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """CPU µs per layer call of each way of computing the updates, for a decoding and a prefill routing."""
    model = build(shape)
    adapters = make_adapters(model, args.adapters, tuple(args.ranks))
    layers = {name: model.get_submodule(name) for name in lora_layers(model)}
    n_slots, max_rank = len(adapters), max(args.ranks)
    routing = LoRARouting(n_slots, 512, torch.device("cpu"))
    banks = {}
    for name, layer in layers.items():
        bank = banks[name] = LoRASlots(layer.in_features, layer.out_features, n_slots, max_rank, routing,
                                       torch.device("cpu"), torch.float32)
        for slot, adapter in enumerate(adapters.values()):
            lora = adapter.get(name)
            bank.load(slot, *((lora.lora_A.detach(), lora.lora_B.detach() * lora.scaling) if lora else (None, None)))
    rng = random.Random(0)
    prefill: list[int] = []
    while len(prefill) < 512:
        prefill += [rng.randrange(n_slots)] * rng.randint(*args.prompt_len)
    routings = {"decode": [i % n_slots for i in range(args.requests)], "prefill": prefill[:512]}
    table = {}
    for step, token_slots in routings.items():
        routing.route(token_slots)
        calls = LayerCalls(banks, token_slots)
        row = table[f"{shape} {step}"] = {}
        for how in ("first op", *(k for k in KERNELS if k != "auto"), "auto", "concat + mask"):
            calls.run(how)  # warm
            start = time.process_time()
            for _ in range(args.kernel_repeats):
                calls.run(how)
            row[how] = (time.process_time() - start) / args.kernel_repeats / len(banks) * 1e6
    return table


class LayerCalls:
    """One routed step's update of every layer, by a chosen way (the layers in turn, as a forward pass runs them)."""

    def __init__(self, banks: dict[str, LoRASlots], token_slots: list[int]) -> None:
        n = len(token_slots)
        self.banks = banks
        self.xs = {d: torch.randn(n, d) for d in {bank.in_features for bank in banks.values()}}
        self.ys = {d: torch.randn(n, d) for d in {bank.out_features for bank in banks.values()}}
        self.first = {name: FirstOp(bank) for name, bank in banks.items()}
        # the concatenated slots (scaling already in B) and the 0/1 mask of each row's own slot's columns
        self.concat = {name: (bank.a_t.permute(1, 0, 2).reshape(bank.in_features, -1).contiguous(),
                              bank.b_t.reshape(-1, bank.out_features).contiguous()) for name, bank in banks.items()}
        max_rank = next(iter(banks.values())).max_rank
        columns = torch.arange(len(next(iter(banks.values())).ranks) * max_rank) // max_rank
        self.mask = (torch.tensor(token_slots)[:, None] == columns[None, :]).float()

    def run(self, how: str) -> None:
        for name, bank in self.banks.items():
            x, y, routing = self.xs[bank.in_features], self.ys[bank.out_features], bank.routing
            if how == "first op":
                self.first[name](None, (x,), y)
            elif how == "concat + mask":
                y.add_(mask_concat(x, *self.concat[name], self.mask))
            else:  # in place into the layer's output, as the engine's eager steps
                add_slot_lora_(y, x, bank.a_t, bank.b_t, bank.ranks, routing.order, routing.offsets, routing.cells,
                               routing.padded, routing.longest, how, routing.workspace)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["demo", "gpt2"], default=["demo", "gpt2"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs=2, default=[8, 64], metavar=("LOW", "HIGH"))
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("LOW", "HIGH"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall-clock seconds, or the process's CPU seconds (for a machine other jobs share)")
    p.add_argument("--kernels", action="store_true", help="time the per-layer products alone instead")
    p.add_argument("--kernel-repeats", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a tiny model and 8 requests over 2 adapters")
    args = p.parse_args(argv)
    for flag in ("requests", "adapters", "output_len", "kernel_repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.ranks[0] <= args.ranks[1] or not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error(f"--ranks and --prompt-len take LOW <= HIGH, both >= 1; got {args.ranks} and {args.prompt_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models
    if args.quick:
        models, args.requests, args.adapters, args.ranks, args.output_len = ["quick"], 8, 2, [2, 8], 4
        args.prompt_len, args.kernel_repeats = [4, 12], 2
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {'cpu' if args.kernels else args.clock} clock; {args.requests} "
          f"requests over {args.adapters} "
          f"adapters (rank {args.ranks[0]}-{args.ranks[1]}), prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"tokens, {args.output_len} new tokens each")
    if args.kernels:
        return kernels_main(models, args)
    print("| model | base only tok/s | multi-LoRA tok/s | multi-LoRA, first op tok/s | merged one after another tok/s "
          "| multi / base | first op / base | multi / merged | base / merged (bound) | tokens differing from merged |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for shape in models:
        row = rows[shape] = run(shape, args)
        print(f"| {shape} | {row['base_tok_s']:.0f} | {row['multi_tok_s']:.0f} | {row['first_op_tok_s']:.0f} | "
              f"{row['merged_tok_s']:.0f} | {row['vs_base']:.2f}x | {row['first_op_vs_base']:.2f}x | "
              f"{row['vs_merged']:.2f}x | {row['bound']:.2f}x | {row['mismatched']} of {args.requests} requests |",
              flush=True)
    return rows


def kernels_main(models: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Print ``kernel_table`` for each model."""
    hows = ("first op", "grouped", "padded", "auto", "concat + mask")
    print("CPU µs per layer call (mean over the model's adapted layers)")
    print("| model, step | " + " | ".join(hows) + " |")
    print("|---" * (len(hows) + 1) + "|")
    rows = {}
    for shape in models:
        for key, row in kernel_table(shape, args).items():
            rows[key] = row
            print(f"| {key} | " + " | ".join(f"{row[h]:.0f}" for h in hows) + " |", flush=True)
    return rows


if __name__ == "__main__":
    main()
