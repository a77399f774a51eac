"""Side-by-side measurements of the zoo against ``transformers`` and ``x-transformers``.

    python -m benchmarks.compare                 # every row, default shapes (about 10-15 minutes on 2 cores)
    python -m benchmarks.compare --rows 1 5      # some rows
    python -m benchmarks.compare --quick         # tiny shapes: checks that the script runs
    python -m benchmarks.compare --rows 7        # SmolLM2-135M / Qwen3-0.6B shapes vs the floor (benchmarks.thin)

Everything is fp32 with dropout 0 and ``torch.manual_seed`` fixed; warm-up runs are excluded and the
competitors are interleaved (A B A B ...) so that drift hits all of them alike. Times are medians. Peak
memory is measured in a fresh subprocess per configuration (the growth of the resident set's high-water
mark during the measured work), because CPU allocations have no allocator statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import blocks
from models import DecoderLM, EncoderLM, Seq2SeqTransformer

# ----------------------------------------------------------------------------------------------- shapes


@dataclass
class Shapes:
    vocab: int = 8192
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    batch: int = 8
    seq: int = 256
    s2s_seq: int = 128
    src_len: int = 32
    new_tokens: int = 96
    s2s_new_tokens: int = 32
    prompt: int = 32
    attn_lengths: tuple[int, ...] = (512, 2048, 8192)
    steps: int = 3
    warmup: int = 1


QUICK = Shapes(vocab=512, d_model=64, n_heads=4, n_layers=2, batch=2, seq=64, s2s_seq=32, src_len=8,
               new_tokens=8, s2s_new_tokens=8, prompt=8, attn_lengths=(128, 256), steps=2, warmup=1)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]
        line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
        out = [f"### {self.title}", "", line(self.columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in self.rows]
        out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out)


# ----------------------------------------------------------------------------------------------- timing


def interleaved(fns: dict[str, Callable[[], object]], steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each function, run A B A B ... after ``warmup`` calls each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """fp32 matmul throughput in FLOP/s (best of ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best


def copy_bandwidth(n_bytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Memory bandwidth in bytes/s for a large copy (bytes read + bytes written)."""
    src = torch.empty(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * n_bytes / best


def read_bandwidth(n_bytes: int = 512 * 2**20, reps: int = 10) -> float:
    """Memory read bandwidth in bytes/s: a sum over a tensor far larger than the caches (best of ``reps``)."""
    src = torch.ones(n_bytes // 4)
    src.sum()
    best = min(_time(src.sum) for _ in range(reps))
    return n_bytes / best


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_rss_growth(spec: dict) -> float:
    """Run ``spec`` in a fresh interpreter and return the growth of peak RSS (bytes) during the work."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--memory-probe", json.dumps(spec)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _maxrss() -> int:
    """Peak resident set size of this process in bytes.

    Read from ``/proc/self/status`` (VmHWM), which starts afresh at ``exec``; ``getrusage``'s ``ru_maxrss`` is
    inherited across ``execve`` on Linux, so a probe started from a large parent would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ----------------------------------------------------------------------------------------------- models


def zoo_decoder(s: Shapes) -> torch.nn.Module:
    return DecoderLM.from_preset(
        "tiny", vocab_size=s.vocab, d_model=s.d_model, n_heads=s.n_heads, d_ff=4 * s.d_model, n_layers=s.n_layers,
        max_len=max(s.seq, s.prompt + s.new_tokens), dropout=0.0, attention_dropout=0.0,
    )


def hf_gpt2(s: Shapes) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=s.vocab, n_positions=max(s.seq, s.prompt + s.new_tokens), n_embd=s.d_model,
                     n_layer=s.n_layers, n_head=s.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def x_decoder(s: Shapes) -> torch.nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=s.vocab, max_seq_len=s.seq, tie_embedding=True,
                              attn_layers=Decoder(dim=s.d_model, depth=s.n_layers, heads=s.n_heads))


def zoo_encoder(s: Shapes) -> torch.nn.Module:
    return EncoderLM.from_preset(
        "tiny", vocab_size=s.vocab, d_model=s.d_model, n_heads=s.n_heads, d_ff=4 * s.d_model, n_layers=s.n_layers,
        max_len=s.seq, dropout=0.0, attention_dropout=0.0,
    )


def hf_bert(s: Shapes) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=s.vocab, hidden_size=s.d_model, num_hidden_layers=s.n_layers,
                     num_attention_heads=s.n_heads, intermediate_size=4 * s.d_model, max_position_embeddings=s.seq,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return BertForMaskedLM(cfg)


def zoo_seq2seq(s: Shapes) -> torch.nn.Module:
    return Seq2SeqTransformer.from_preset(
        "tiny", vocab_size=s.vocab, d_model=s.d_model, n_heads=s.n_heads, d_ff=4 * s.d_model,
        n_encoder_layers=s.n_layers, n_decoder_layers=s.n_layers, max_len=1024, dropout=0.0, output_bias=True,
        pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )


def hf_marian(s: Shapes) -> torch.nn.Module:
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(vocab_size=s.vocab, d_model=s.d_model, encoder_layers=s.n_layers, decoder_layers=s.n_layers,
                       encoder_attention_heads=s.n_heads, decoder_attention_heads=s.n_heads,
                       encoder_ffn_dim=4 * s.d_model, decoder_ffn_dim=4 * s.d_model, activation_function="relu",
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
                       pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, forced_eos_token_id=None,
                       max_position_embeddings=1024, attn_implementation="sdpa")
    return MarianMTModel(cfg)


BUILDERS = {"zoo_decoder": zoo_decoder, "hf_gpt2": hf_gpt2, "x_decoder": x_decoder, "zoo_encoder": zoo_encoder,
            "hf_bert": hf_bert, "zoo_seq2seq": zoo_seq2seq, "hf_marian": hf_marian}


def n_params(model: torch.nn.Module) -> int:
    """Trainable parameters (Marian's fixed sinusoid tables are stored as frozen parameters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------- steps


def train_step(name: str, model: torch.nn.Module, s: Shapes) -> Callable[[], None]:
    """One forward + backward + AdamW step (fused kernel) on a fixed random batch."""
    g = torch.Generator().manual_seed(0)
    # The fused AdamW kernel for every competitor: the default single-tensor loop on CPU costs about as much
    # as the forward and backward of these models, and would hide the differences between them.
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    model.train()
    if name in ("zoo_decoder", "hf_gpt2", "x_decoder"):
        ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
        if name == "x_decoder":
            loss_fn = lambda: torch.nn.functional.cross_entropy(  # noqa: E731
                model(ids[:, :-1]).reshape(-1, s.vocab), ids[:, 1:].reshape(-1))
        elif name == "hf_gpt2":
            loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
        else:
            loss_fn = lambda: model(ids, labels=ids).loss  # noqa: E731
    elif name in ("zoo_encoder", "hf_bert"):
        ids = torch.randint(5, s.vocab, (s.batch, s.seq), generator=g)
        labels = torch.full_like(ids, -100)
        chosen = torch.rand(ids.shape, generator=g) < 0.15
        labels[chosen] = ids[chosen]
        if name == "zoo_encoder":
            loss_fn = lambda: model(ids, labels=labels, masked_only=True).loss  # noqa: E731
        else:
            loss_fn = lambda: model(input_ids=ids, labels=labels).loss  # noqa: E731
    else:
        src = torch.randint(2, s.vocab, (s.batch, s.s2s_seq), generator=g)
        tgt = torch.randint(2, s.vocab, (s.batch, s.s2s_seq), generator=g)
        dec_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], dim=1)
        if name == "zoo_seq2seq":
            loss_fn = lambda: model(src, dec_in, labels=tgt).loss  # noqa: E731
        else:
            loss_fn = lambda: model(input_ids=src, decoder_input_ids=dec_in, labels=tgt).loss  # noqa: E731

    def step() -> None:
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def training_flops_per_token(model: torch.nn.Module, n_layers: int, d_model: int, seq: int, embed: int) -> float:
    """6·N (matmul parameters, embeddings lookups excluded) + 12·layers·d_model·seq for attention scores."""
    return 6 * (n_params(model) - embed) + 12 * n_layers * d_model * seq


# ----------------------------------------------------------------------------------------------- rows


def row_training(title: str, names: list[str], s: Shapes, tokens: int, seq: int, peak: float,
                 n_attn_layers: int, memory: bool, flop_tokens: int | None = None) -> Table:
    """Training throughput; ``flop_tokens`` is how many tokens pass through every parameter (for an
    encoder-decoder, one side's tokens: the encoder sees the source, the decoder the target)."""
    flop_tokens = tokens if flop_tokens is None else flop_tokens
    torch.manual_seed(0)
    models = {n: BUILDERS[n](s) for n in names}
    steps = {n: train_step(n, m, s) for n, m in models.items()}
    secs = interleaved(steps, s.steps, s.warmup)
    base = names[1]
    table = Table(title, ["model", "params", "tokens/s", "ratio zoo/this", "MFU", "peak memory growth"])
    for n in names:
        embed = s.vocab * s.d_model
        flops = training_flops_per_token(models[n], n_attn_layers, s.d_model, seq, embed) * flop_tokens / secs[n]
        mem = f"{peak_rss_growth({'kind': 'train', 'name': n, 'shapes': s.__dict__}) / 2**20:.0f} MiB" \
            if memory else "-"
        table.rows.append([n, f"{n_params(models[n]) / 1e6:.2f}M", f"{tokens / secs[n]:.0f}",
                           f"{secs[n] / secs[names[0]]:.2f}x", f"{flops / peak:.0%}", mem])
    table.notes.append(f"ratio = zoo tokens/s ÷ this model's tokens/s (base of comparison: {base}).")
    return table


def first_and_steady(fns: dict[str, Callable[[], object]], steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each function's first call (a compiled variant compiles there), then interleaved medians."""
    first = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            first[name] = _time(fn)
        return first, interleaved(fns, steps, 0)


def hf_decode(model: torch.nn.Module, ids: torch.Tensor, new: int, beams: int = 1, compiled: bool = False,
              **extra: object) -> Callable[[], object]:
    """``transformers`` ``generate``, exactly ``new`` tokens; ``compiled``: static cache and its compiled step."""
    from transformers import CompileConfig

    kwargs: dict = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, num_beams=beams, **extra)
    if compiled:
        config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told so
        kwargs.update(cache_implementation="static", compile_config=config)
    model.eval()
    return lambda: model.generate(**kwargs)


def _ms(secs: float, tokens: int) -> str:
    return f"{secs / tokens * 1e3:.2f}"


def row_decoding(s: Shapes, bandwidth: float, hf_compiled: bool) -> Table:
    """GPT-2-shape greedy decoding, batch 1 and 8: the zoo eager and compiled against transformers eager and
    transformers' static-cache compiled step, with first-call cost, break-even and the weight-read floor."""
    torch.manual_seed(0)
    zoo, hf = zoo_decoder(s).eval(), hf_gpt2(s).eval()
    n = s.new_tokens
    weight_bytes = sum(p.numel() * p.element_size() for p in zoo.parameters())
    floor = weight_bytes / bandwidth
    table = Table(f"4. Decoding (greedy, DecoderLM vs GPT2LMHeadModel.generate, {s.prompt}-token prompt, {n} new "
                  "tokens)",
                  ["batch", "variant", "ms/token", "vs transformers eager", "vs transformers compiled",
                   "÷ weight-read floor", "first call s", "compile s", "break-even tokens"])
    for batch in (1, 8):
        ids = torch.randint(1, s.vocab, (batch, s.prompt), generator=torch.Generator().manual_seed(batch))
        fns = {"transformers eager": hf_decode(hf, ids, n)}
        if hf_compiled:
            fns["transformers compiled"] = hf_decode(hf, ids, n, compiled=True)
        fns["zoo eager"] = lambda ids=ids: zoo.generate(ids, max_new_tokens=n, eos_token_id=None)
        fns["zoo compiled"] = lambda ids=ids: zoo.generate(ids, max_new_tokens=n, eos_token_id=None, compile=True)
        first, secs = first_and_steady(fns, s.steps)
        add_variants(table, str(batch), fns, first, secs, n, floor)
    table.notes.append(f"ms/token = ms per decoding step (one new token for each of the batch's rows); floor = "
                       f"weight bytes ({weight_bytes / 2**20:.0f} MiB, read once per step) ÷ measured read "
                       f"bandwidth = {floor * 1e3:.2f} ms.")
    table.notes.append("first call = a fresh process's first generate (compiled variants compile there; the "
                       "inductor cache starts empty); compile s = first call − steady call; break-even = compile s "
                       "÷ ms saved per token against the same library's eager path.")
    if not hf_compiled:
        table.notes.append("transformers' compiled step skipped (--quick).")
    return table


def add_variants(table: Table, label: str, fns: dict, first: dict, secs: dict, tokens: int, floor: float | None,
                 ) -> None:
    """One table row per variant (see ``row_decoding`` for the columns)."""
    base = secs["transformers eager"]
    for name in fns:
        compile_s = first[name] - secs[name]
        eager = secs.get(name.replace("compiled", "eager"), secs[name])
        saved = (eager - secs[name]) / tokens
        even = f"{compile_s / saved:.0f}" if "compiled" in name and saved > 0 else "-"
        versus = f"{secs['transformers compiled'] / secs[name]:.2f}x" if "transformers compiled" in secs else "-"
        table.rows.append([label, name, _ms(secs[name], tokens), f"{base / secs[name]:.2f}x", versus,
                           "-" if floor is None else f"{secs[name] / tokens / floor:.2f}x", f"{first[name]:.2f}",
                           f"{compile_s:.1f}" if "compiled" in name else "-", even])


def row_int8_decoding(s: Shapes, bandwidth: float) -> Table:
    """Batch-1 greedy decoding with int8 weights against the fp32 model, both compiled."""
    from models import DecoderLMConfig

    torch.manual_seed(0)
    zoo = zoo_decoder(s).eval()
    int8 = DecoderLM(DecoderLMConfig(**{**zoo.config.__dict__})).eval()
    int8.load_state_dict(zoo.state_dict())
    int8.quantize("int8")
    ids = torch.randint(1, s.vocab, (1, s.prompt), generator=torch.Generator().manual_seed(0))
    n = s.new_tokens
    fns = {
        "fp32 compiled": lambda: zoo.generate(ids, max_new_tokens=n, eos_token_id=None, compile=True),
        "int8 compiled": lambda: int8.generate(ids, max_new_tokens=n, eos_token_id=None, compile=True),
        "int8 eager": lambda: int8.generate(ids, max_new_tokens=n, eos_token_id=None),
    }
    first, secs = first_and_steady(fns, s.steps)
    fp32_bytes = sum(p.numel() * p.element_size() for p in zoo.parameters())
    # What a step reads: every linear weight (int8 + scale) and the float norms/biases; of the float embedding
    # tables, one row each (the head has its own int8 copy).
    embeddings = {id(m.weight) for m in int8.modules() if isinstance(m, torch.nn.Embedding)}
    int8_bytes = sum(t.numel() * t.element_size() for t in [*int8.parameters(), *int8.buffers()]
                     if id(t) not in embeddings)
    weights = {"fp32 compiled": fp32_bytes, "int8 compiled": int8_bytes, "int8 eager": int8_bytes}
    table = Table(f"6. int8 weights (batch 1, greedy, {s.prompt}-token prompt, {n} new tokens)",
                  ["variant", "ms/token", "vs fp32 compiled", "weights read MiB", "÷ weight-read floor",
                   "first call s"])
    for name in fns:
        floor = weights[name] / bandwidth
        table.rows.append([name, _ms(secs[name], n), f"{secs['fp32 compiled'] / secs[name]:.2f}x",
                           f"{weights[name] / 2**20:.1f}", f"{secs[name] / n / floor:.2f}x", f"{first[name]:.1f}"])
    table.notes.append("weights read = int8 weights and scales + float norms and biases (the fp32 row counts every "
                       "parameter once, the tied head included); floor = that ÷ measured read bandwidth.")
    return table


def row_seq2seq_decoding(s: Shapes) -> Table:
    """Marian-shape decoding, batch 1: greedy and beam-4, zoo eager and compiled against MarianMTModel.generate."""
    torch.manual_seed(0)
    zoo, hf = zoo_seq2seq(s).eval(), hf_marian(s).eval()
    n = s.s2s_new_tokens
    src = torch.randint(2, s.vocab, (1, s.src_len), generator=torch.Generator().manual_seed(0))
    table = Table(f"3b. Seq2Seq decoding (Seq2SeqTransformer vs MarianMTModel.generate, batch 1, {s.src_len}-token "
                  f"source, {n} new tokens)",
                  ["search", "variant", "ms/token", "vs transformers eager", "vs transformers compiled",
                   "÷ weight-read floor", "first call s", "compile s", "break-even tokens"])
    for beams in (1, 4):
        beam_options = dict(early_stopping=False, length_penalty=0.6) if beams > 1 else {}
        fns = {
            "transformers eager": hf_decode(hf, src, n, beams, **beam_options),
            "zoo eager": lambda b=beams: zoo.generate(src, max_new_tokens=n, num_beams=b, eos_token_id=None),
            "zoo compiled": lambda b=beams: zoo.generate(src, max_new_tokens=n, num_beams=b, eos_token_id=None,
                                                         compile=True),
        }
        first, secs = first_and_steady(fns, s.steps)
        add_variants(table, "greedy" if beams == 1 else f"beam-{beams}", fns, first, secs, n, None)
    table.notes.append("no early stop; ms/token includes encoding the source once per call.")
    return table


def _attention_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    fn = blocks.get("attention_backend", name)
    return lambda: fn(q, k, v, is_causal=True)


def row_backends(s: Shapes, memory: bool) -> Table:
    table = Table("5. Attention backends (causal, batch 1, 8 heads, d_head 64, forward)",
                  ["L", "backend", "ms", "peak memory growth", "memory vs math"])
    for length in s.attn_lengths:
        q, k, v = (torch.randn(1, 8, length, 64) for _ in range(3))
        fns = {n: _attention_call(n, q, k, v) for n in blocks.names("attention_backend")}
        with torch.inference_mode():
            secs = interleaved(fns, s.steps, s.warmup)
        mems = {n: peak_rss_growth({"kind": "attention", "name": n, "length": length}) if memory else float("nan")
                for n in fns}
        for n in fns:
            table.rows.append([str(length), n, f"{secs[n] * 1e3:.1f}", f"{mems[n] / 2**20:.0f} MiB",
                               f"{mems[n] / mems['math']:.2f}"])
    return table


# ----------------------------------------------------------------------------------------------- memory probe


def memory_probe(spec: dict) -> float:
    """Body of the subprocess: build, then measure the high-water growth of the measured work."""
    torch.manual_seed(0)
    if spec["kind"] == "attention":
        q, k, v = (torch.randn(1, 8, spec["length"], 64) for _ in range(3))
        fn = blocks.get("attention_backend", spec["name"])
        before = _maxrss()
        with torch.inference_mode():
            fn(q, k, v, is_causal=True)
        return _maxrss() - before
    s = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["shapes"].items()})
    model = BUILDERS[spec["name"]](s)
    step = train_step(spec["name"], model, s)
    before = _maxrss()
    step()
    step()
    return _maxrss() - before


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7], help="which rows to run")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script runs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(memory_probe(json.loads(args.memory_probe)))
        return
    s = QUICK if args.quick else Shapes()
    if args.quick:
        # A smoke run: dynamo captures the same graphs, without inductor's C++ build (minutes on 2 cores).
        import models.generation.compiled

        models.generation.compiled.BACKEND = "aot_eager"
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        # First calls are reported: compile from an empty cache, as a user's first run does.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-bench-inductor-")
    memory = not args.no_memory
    peak, bandwidth, read = matmul_peak(), copy_bandwidth(), read_bandwidth()
    print(f"# transformer-zoo benchmarks\n\nmachine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, fp32\n"
          f"fp32 matmul peak: {peak / 1e9:.0f} GFLOP/s; copy bandwidth: {bandwidth / 1e9:.1f} GB/s; "
          f"read bandwidth: {read / 1e9:.1f} GB/s\n", flush=True)
    if 1 in args.rows:
        print(row_training(f"1. Training: DecoderLM vs GPT2LMHeadModel vs x-transformers "
                           f"({s.n_layers} layers, d_model {s.d_model}, batch {s.batch}×{s.seq})",
                           ["zoo_decoder", "hf_gpt2", "x_decoder"], s, s.batch * s.seq, s.seq, peak,
                           s.n_layers, memory).render(), "\n", flush=True)
    if 2 in args.rows:
        print(row_training(f"2. MLM training: EncoderLM vs BertForMaskedLM (15% labelled, batch {s.batch}×{s.seq})",
                           ["zoo_encoder", "hf_bert"], s, s.batch * s.seq, s.seq, peak, s.n_layers,
                           memory).render(), "\n", flush=True)
    if 3 in args.rows:
        print(row_training(f"3a. Seq2Seq training: Seq2SeqTransformer vs MarianMTModel "
                           f"({s.n_layers}+{s.n_layers} layers, batch {s.batch}×({s.s2s_seq}+{s.s2s_seq}))",
                           ["zoo_seq2seq", "hf_marian"], s, s.batch * s.s2s_seq * 2, s.s2s_seq, peak,
                           3 * s.n_layers, memory, flop_tokens=s.batch * s.s2s_seq).render(), "\n", flush=True)
        print(row_seq2seq_decoding(s).render(), "\n", flush=True)
    if 4 in args.rows:
        print(row_decoding(s, read, hf_compiled=not args.quick).render(), "\n", flush=True)
    if 5 in args.rows:
        print(row_backends(s, memory).render(), "\n", flush=True)
    if 6 in args.rows:
        print(row_int8_decoding(s, read).render(), "\n", flush=True)
    if 7 in args.rows:
        # Deep, thin decoders (benchmarks.thin, which imports this module): its own process, its own figures.
        thin = [sys.executable, "-m", "benchmarks.thin", *(["--quick"] if args.quick else [])]
        out = subprocess.run(thin, capture_output=True, text=True, check=True).stdout
        print(out[out.index("### 7."):].rstrip(), "\n", flush=True)


if __name__ == "__main__":
    main()
