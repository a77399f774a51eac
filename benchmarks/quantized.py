"""Quantized GGUF models run quantized: decode speed against the weight-read floor, memory against the file size,
the engine against float32, and llama.cpp on the same files — one run, one thread.

    python -m benchmarks.quantized                       # SmolLM2-135M and Qwen3-0.6B shapes, Q8_0 and Q4_0
    python -m benchmarks.quantized --shapes smollm2 --types Q8_0
    python -m benchmarks.quantized --llama-bench /path/to/llama-bench   # adds llama.cpp's tg tokens/s
    python -m benchmarks.quantized --quick               # a tiny model: checks that the script runs

Each shape is built with random weights (a ``DecoderLM`` of the family's sizes, tied embeddings as both models
have) and written once per type with ``models.gguf.export.save_gguf``, whose blocks come from the ``gguf``
package's quantizers. The file embeds a byte-level BPE vocabulary of the model's size shaped as real ones are
(``filler_tokenizer``: 256 byte symbols, one token per merge, two special tokens), so that loading it costs what
loading the real model's tokenizer costs. Every measurement then runs in a fresh Python process with one torch thread:

- **decode**: ``models.from_pretrained(file)`` (blocks kept packed), then batch-1 greedy ``generate`` of
  ``--tokens`` tokens, eager and ``compile=True`` (warmed up first), ms per decoding step: the time of a run of
  one token (the 16-token prompt's forward and the first choice, reported as "prompt ms") is taken from the time
  of a run of ``--tokens``, over the ``--tokens`` - 1 steps left, as llama-bench's tg (which has no prompt)
  times decoding alone; best of two runs each. The **floor** is the bytes one token
  reads (every packed weight, the float parameters and the KV cache at the mean context) divided by the read
  bandwidth of the same process (``tensor.sum()`` over 512 MiB, best of 5); the ratio to it is the target
  (≤ 1.3× compiled).
- **memory**: the process's resident high-water mark (``VmHWM``) grown over its resident set after the imports,
  after loading and after decoding, against the file size (+ the KV cache).
- **engine**: ``serving.Engine`` with 16 requests at once (prompts of 32 tokens, ``--tokens`` new tokens each),
  output tokens/s, on the packed file and on the same file loaded as float32 (``dequantize=True``).
- **llama.cpp** (with ``--llama-bench``): ``llama-bench -t 1 -p 0 -n TOKENS`` on the same file, tg tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # SmolLM2-135M: 30 x 576, 9 heads of 64 (3 key/value heads), d_ff 1536, vocabulary 49152, tied.
    "smollm2": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_ff=1536),
    # Qwen3-0.6B: 28 x 1024, 16 heads of 128 (8 key/value heads), d_ff 3072, vocabulary 151936, tied, q/k norms.
    "qwen3": dict(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, d_head=128, d_ff=3072),
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_head=32, d_ff=256),
}
FAMILY = {"smollm2": "llama", "qwen3": "qwen3", "tiny": "llama"}


def build_file(shape: str, qtype: str, folder: Path) -> Path:
    """The shape's random-weight model written as a GGUF file of ``qtype`` (cached in ``folder``)."""
    path = folder / f"{shape}-{qtype}-bpe.gguf"  # "-bpe": files with an older filler vocabulary are not reused
    if path.exists():
        return path
    import torch

    from models import DecoderLM, DecoderLMConfig

    sizes = SHAPES[shape]
    options: dict = {"positional": {"base": 100000.0}}
    if FAMILY[shape] == "qwen3":
        options["attention"] = {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6}
    config = DecoderLMConfig(**sizes, max_len=8192, dropout=0.0, positional="rotary", ffn="swiglu", norm="rmsnorm",
                             norm_eps=1e-6, sublayer="pre_norm", bias=False, tie_embeddings=True, options=options)
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    model.tokenizer = filler_tokenizer(sizes["vocab_size"])  # llama.cpp needs a vocabulary in the file
    model.save_gguf(path, qtype, model_type=FAMILY[shape])
    del model
    return path


#: How many byte symbols each token of the filler vocabulary is extended by: 3 gives Qwen3's 151936 tokens a mean
#: length of 6.1 symbols (SmolLM2's 49152: 5.1).
FILLER_FANOUT = 3


def filler_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with ``vocab_size`` ids, built the way a real model's vocabulary is shaped.

    SmolLM2's and Qwen3's vocabularies are byte-level BPE: the 256 byte symbols, then one token per merge (about
    ``vocab_size`` merges) and a handful of special tokens, which is what a GGUF file of them stores and what
    reading it costs. Here: ``<|bos|>`` and ``<|eos|>`` (ids 0 and 1), the 256 byte symbols, then tokens of growing
    length, each the merge of a known token (breadth first) and one of ``FILLER_FANOUT`` byte symbols (rotating
    over the alphabet), until ``vocab_size``. Training a vocabulary this size would take minutes; filling one with
    added tokens (as this benchmark once did) gives a file no converter writes, which costs more to read (each
    added token is matched whole) and so overstates the tokenizer's part of the load.

    Args:
        vocab_size: the number of ids, at least 258.

    Returns:
        The ``tokenization.Tokenizer``.

    Raises:
        ValueError: a ``vocab_size`` below 258.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from tokenization import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|bos|>", "<|eos|>"]
    tokens = specials + alphabet
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size}: expected at least {len(tokens)} (2 special + 256 byte tokens)")
    merges: list[tuple[str, str]] = []
    known = len(specials)  # the next token to extend: breadth first, so lengths grow one symbol at a time
    while len(tokens) < vocab_size:
        left = tokens[known]
        known += 1
        for _ in range(min(FILLER_FANOUT, vocab_size - len(tokens))):
            right = alphabet[len(merges) % len(alphabet)]
            merges.append((left, right))
            tokens.append(left + right)  # never seen before: each token spells its own path of byte symbols
    backend = Backend(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer = Tokenizer(backend, {"bos": specials[0], "eos": specials[1]})
    tokenizer.set_template("decoder")
    return tokenizer


CHILD_DECODE = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import models, models.gguf, models.convert.llama, models.convert.qwen3
from blocks.quantized import QuantizedLinear

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

path, tokens, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
base = status("VmRSS")
start = time.perf_counter()
model = models.from_pretrained(path, dequantize=mode == "float")
load_s = time.perf_counter() - start
load_peak = status("VmHWM") - base
c = model.config
packed = {id(m): m.nbytes() for m in model.modules() if isinstance(m, QuantizedLinear)}
weights = sum(packed.values()) + sum(p.numel() * p.element_size() for p in model.parameters())
kv_per_token = 2 * c.n_layers * c.n_kv_heads * c.d_head * 4
prompt = torch.randint(0, c.vocab_size, (1, 16))
out = {"load_s": load_s, "load_peak": load_peak, "weights": weights, "kv_per_token": kv_per_token}
for compiled in (False, True):
    if compiled:  # the compiler's own code, resident once per process whatever the model: reported apart
        before = status("VmRSS")
        import torch._dynamo, torch._inductor.compile_fx  # noqa: E401, F401
        out["compiler_code"] = status("VmRSS") - before
    def timed(n):
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, compile=compiled, eos_token_id=None)
        return time.perf_counter() - start
    with torch.no_grad():
        # Warm-up with the timed length: every cache bucket the timed run reaches is compiled here.
        timed(tokens)
        # Decoding only, as llama-bench's tg: a run of one token (the prompt's forward and the first choice) is
        # taken from a run of ``tokens``, leaving the tokens - 1 decoding steps; best of two each.
        full, first = min(timed(tokens) for _ in range(2)), min(timed(1) for _ in range(2))
    name = "compiled" if compiled else "eager"
    out[name] = (full - first) / (tokens - 1)
    out[name + "_prompt"] = first
    out[name + "_peak"] = status("VmHWM") - base
probe = torch.ones(128 << 20)  # 512 MiB
best = min((lambda s: (probe.sum(), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(5))
out["bandwidth"] = probe.numel() * 4 / best
out["kv_bytes"] = kv_per_token * (16 + tokens)
out["read_per_token"] = weights + kv_per_token * (16 + tokens / 2)
print(json.dumps(out))
"""

CHILD_ENGINE = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import models, models.gguf, models.convert.llama, models.convert.qwen3
from serving import Engine
path, tokens, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = models.from_pretrained(path, dequantize=mode == "float")
engine = Engine(model, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, model.config.vocab_size, (32,), generator=gen).tolist() for _ in range(16)]
engine.generate(prompts[:2], max_tokens=4)  # warm-up
start = time.perf_counter()
outputs = engine.generate(prompts, max_tokens=tokens)
seconds = time.perf_counter() - start
print(json.dumps({"tokens_per_s": 16 * tokens / seconds}))
"""


def child(code: str, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, path: Path, tokens: int) -> float:
    """llama.cpp's tg tokens/s on ``path`` at one thread."""
    done = subprocess.run([binary, "-m", str(path), "-t", "1", "-p", "0", "-n", str(tokens), "-o", "json"],
                          capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "qwen3"], choices=sorted(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-bench", default=None, help="path to llama.cpp's llama-bench")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine rows")
    parser.add_argument("--folder", default=None, help="where the GGUF files are kept (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.tokens = ["tiny"], 8
    if args.tokens < 2:  # decoding steps are timed as a run of --tokens less a run of one
        parser.error(f"--tokens={args.tokens}: expected at least 2")
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="zoo-quantized-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"one thread each; files in {folder}")
    header = (f"{'model':>8} {'type':>5} {'file MiB':>8} {'floor ms':>8} {'prompt ms':>9} "
              f"{'eager ms':>8} {'compiled':>8} "
              f"{'x floor':>7} {'GB/s':>5} {'load/file':>9} {'decode/(file+kv)':>16} {'w/o compiler':>12} "
              f"{'engine':>7} {'f32 eng':>7} "
              f"{'x f32':>5} {'llama tok/s':>11} {'x llama':>7}")
    print(header)
    for shape in args.shapes:
        for qtype in args.types:
            path = build_file(shape, qtype, folder)
            size = path.stat().st_size
            d = child(CHILD_DECODE, str(path), str(args.tokens), "packed")
            floor = d["read_per_token"] / d["bandwidth"]
            row = (f"{shape:>8} {qtype:>5} {size / 2**20:8.1f} {floor * 1e3:8.2f} "
                   f"{d['compiled_prompt'] * 1e3:9.1f} {d['eager'] * 1e3:8.2f} "
                   f"{d['compiled'] * 1e3:8.2f} {d['compiled'] / floor:7.2f} {d['bandwidth'] / 1e9:5.1f} "
                   f"{d['load_peak'] / size:9.2f} {d['compiled_peak'] / (size + d['kv_bytes']):16.2f} "
                   f"{(d['compiled_peak'] - d['compiler_code']) / (size + d['kv_bytes']):12.2f}")
            if not args.no_engine:
                packed = child(CHILD_ENGINE, str(path), str(args.tokens), "packed")["tokens_per_s"]
                floats = child(CHILD_ENGINE, str(path), str(args.tokens), "float")["tokens_per_s"]
                row += f" {packed:7.1f} {floats:7.1f} {packed / floats:5.2f}"
            else:
                row += f" {'-':>7} {'-':>7} {'-':>5}"
            if args.llama_bench:
                tg = llama_bench(args.llama_bench, path, args.tokens)
                row += f" {tg:11.1f} {1 / d['compiled'] / tg:7.2f}"
            print(row, flush=True)
    print("x floor: compiled ms/token over the floor (bytes read per token / GB/s); load/file and "
          "decode/(file+kv): resident growth over the process after its imports, at its peak (w/o compiler: less "
          "the resident size of importing torch._dynamo and inductor, which compiling needs once per process); "
          "engine: 16 requests at once, output tokens/s, packed and float32 (dequantize=True); x llama: compiled "
          f"zoo tokens/s over llama-bench tg tokens/s ({time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
