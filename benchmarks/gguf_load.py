"""Loading a GGUF file: the zoo's ``models.from_pretrained`` beside ``transformers``' GGUF loader, in the same run.

    python -m benchmarks.gguf_load              # SmolLM2-135M-shaped llama (30 x 576, vocabulary 49152), Q8_0
    python -m benchmarks.gguf_load --dtype Q4_K # the same shape as Q4_K (random valid blocks)
    python -m benchmarks.gguf_load --quick      # a tiny llama: checks that the script runs

The file is written once (random weights, ``save_gguf`` with ``gguf``'s Q8_0 quantizer; the ``gguf`` package has no
K-quant quantizer, so a Q4_K file gets random valid blocks). Each load then runs in a fresh Python process, imports
done before the clock starts (including ``torch._refs``, which the zoo converter's first meta-device build imports),
alternating zoo / transformers, ``--repeats`` times; the figures are medians. Peak memory is the process's resident
high-water mark (``VmHWM``) and its growth over the resident set after the imports, against the size of the loaded
float32 model (its parameters' bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r"""
import json, sys, time
import gguf, torch
path, which = sys.argv[1], sys.argv[2]
if which == "zoo":
    import models, models.gguf, models.convert.llama
    import torch._refs  # what the converter's first meta-device build imports (about 2 s, once per process)
    load = lambda: models.from_pretrained(path)
else:
    import accelerate, transformers
    import transformers.modeling_gguf_pytorch_utils, transformers.models.llama.modeling_llama
    from pathlib import Path
    p = Path(path)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                                     dtype=torch.float32)
def status(key):  # VmHWM is this process's own high-water mark (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
base = status("VmRSS")
start = time.perf_counter()
model = load()
seconds = time.perf_counter() - start
peak = status("VmHWM")
size = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
print(json.dumps({"seconds": seconds, "peak": peak, "base": base, "model_bytes": size}))
"""


def smollm_135m_shaped(quick: bool):
    """A zoo DecoderLM of SmolLM2-135M's llama shape (random weights), via the llama converter."""
    import transformers

    from models.convert import from_transformers

    if quick:
        sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    else:
        sizes = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3)
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    converted = from_transformers(config.to_dict(), hf.state_dict())
    model = converted.architecture(converted.config)
    model.load_state_dict(converted.state_dict, strict=False)
    return model


def as_q4_k(source: Path, target: Path) -> None:
    """``source`` rewritten with every matrix as random valid Q4_K blocks (finite fp16 scales ``d``, ``dmin``), or
    Q5_0 where a row is no whole number of Q4_K's 256-element blocks (as llama.cpp's quantize falls back).

    The ``gguf`` package cannot quantize to Q4_K; the weights are random anyway, and loading time depends on the
    type's decoding, not on the values.
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        if len(shape) == 2 and shape[1] % block == 0:
            data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
            scales = rng.uniform(0.001, 0.02, size=(*data.shape[:2], 2)).astype(np.float16)
            data[..., :4] = scales.view(np.uint8).reshape(*data.shape[:2], 4)
            writer.add_tensor(tensor.name, data.reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif len(shape) == 2:  # rows that are no whole number of 256-blocks: Q5_0, llama.cpp's fallback for Q4_K
            values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
            q5 = gguf.GGMLQuantizationType.Q5_0
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, q5), raw_dtype=q5)
        else:
            writer.add_tensor(tensor.name, np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_in_child(path: Path, which: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), which], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="Q8_0",
                        help="ggml type of the matrices: a type save_gguf writes, or Q4_K (random valid blocks)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"smollm2-135m-shaped.{args.dtype}.gguf"
        model = smollm_135m_shaped(args.quick)
        params = sum(p.numel() for p in model.parameters())
        if args.dtype == "Q4_K":
            model.save_gguf(Path(folder) / "f32.gguf", "F32")
            as_q4_k(Path(folder) / "f32.gguf", path)
            (Path(folder) / "f32.gguf").unlink()
        else:
            model.save_gguf(path, args.dtype)
        del model
        print(f"file: {path.name}, {params / 1e6:.1f}M parameters, {path.stat().st_size / 2**20:.0f} MiB; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        runs: dict[str, list[dict[str, float]]] = {"zoo": [], "transformers": []}
        for _ in range(args.repeats):
            for which in runs:
                runs[which].append(load_in_child(path, which))
    print("| loader | load time (s) | ratio to transformers | peak RSS (MiB) | RSS growth (MiB) | growth / model |")
    print("|---|---|---|---|---|---|")
    ref = statistics.median(r["seconds"] for r in runs["transformers"])
    for which, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = statistics.median(r["peak"] for r in results)
        growth = statistics.median(r["peak"] - r["base"] for r in results)
        size = results[0]["model_bytes"]
        print(f"| {which} | {seconds:.2f} | {seconds / ref:.2f}x | {peak / 2**20:.0f} | {growth / 2**20:.0f} | "
              f"{growth / size:.2f}x of {size / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
