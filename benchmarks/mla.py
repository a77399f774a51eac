"""Decoding a DeepSeek-shaped latent-attention model: KV-cache bytes per token and ms per token, zoo against
``transformers`` on the same weights and prompt.

``python -m benchmarks.mla`` builds a ``transformers`` ``DeepseekV2ForCausalLM`` with DeepSeek-V2-Lite's attention
(width 2048, 16 heads, ``kv_lora_rank`` 512, rotary 64 + 128 other query/key dims, values 128, no query
compression) and a reduced body (``--layers`` layers, the first dense, 8 routed experts top-2 + 2 shared, vocabulary
16000), converts it (``models.convert.from_transformers``), and decodes ``--new`` greedy tokens after a
``--prompt``-token prompt (batch 1, fp32, CPU) with each model's own cache: the zoo with ``new_caches`` (latent
caches, absorbed steps), ``transformers`` with its ``DynamicCache``. ms/token times the decoding steps alone
(process CPU time, one thread by default; the prefill is not timed), competitors interleaved, medians of
``--repeats``; the greedy tokens of both are checked equal.

Cache bytes per token (all layers, one sequence) are read from the caches themselves after decoding: the zoo's
``LatentKVCache`` s and ``transformers``' ``DynamicCache``. Also printed: what a per-head key/value cache of the same
model would hold (``n_heads · (d_head + d_value)`` numbers per layer), the cache MLA is designed to replace.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from models import DecoderLM
from models.convert import from_transformers
from models.core.stack import new_caches

SHAPE = dict(vocab_size=16000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
             first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=8192, bos_token_id=0,
             eos_token_id=1)


def decode(step: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, new: int) -> tuple[float, list[int]]:
    """Greedy decoding of ``new`` tokens from ``logits`` with ``step`` (token -> next logits): process CPU seconds per
    step (one thread: the work done, time descheduled on a shared machine left out) and the tokens."""
    tokens, spent = [], 0.0
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        tokens.append(int(token))
        start = time.process_time()
        logits = step(token)
        spent += time.process_time() - start
    return spent / new, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: on a shared machine, 2-thread kernels wait on descheduled threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**SHAPE, num_hidden_layers=args.layers)
    hf = transformers.DeepseekV2ForCausalLM(config).float().eval()
    converted = from_transformers(config.to_dict(), hf.state_dict())
    zoo = DecoderLM(converted.config).eval()
    zoo.load_state_dict(converted.state_dict)
    prompt = torch.randint(2, SHAPE["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))

    c = zoo.config
    per_head = c.n_layers * c.n_heads * (c.d_head + c.d_value) * 4

    @torch.inference_mode()
    def run_zoo() -> tuple[float, list[int], float]:
        caches = new_caches(zoo.layers, args.prompt + args.new)
        logits = zoo(prompt, cache=caches, logits_to_keep=1).logits[:, -1]
        seconds, tokens = decode(lambda t: zoo(t, cache=caches).logits[:, -1], logits, args.new)
        return seconds, tokens, sum(cache.self_attn.bytes_per_token() for cache in caches)

    @torch.inference_mode()
    def run_hf() -> tuple[float, list[int], float]:
        out = hf(input_ids=prompt, use_cache=True, logits_to_keep=1)
        past = out.past_key_values

        def step(token: torch.Tensor) -> torch.Tensor:
            return hf(input_ids=token, past_key_values=past, use_cache=True).logits[:, -1]

        seconds, tokens = decode(step, out.logits[:, -1], args.new)
        length = past.get_seq_length()
        return seconds, tokens, sum(layer.keys.nbytes + layer.values.nbytes for layer in past.layers) / length

    runs = {"zoo": run_zoo, "transformers": run_hf}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        results = {name: run() for name, run in runs.items()}
        for name, (seconds, _, _) in results.items():
            times[name].append(seconds)
    same = results["zoo"][1] == results["transformers"][1]
    zoo_bytes, hf_bytes = results["zoo"][2], results["transformers"][2]
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"fp32, batch 1, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens, median of "
          f"{args.repeats}; greedy tokens equal: {same}")
    print("| | KV-cache bytes/token (all layers) | ms/token (decoding) |")
    print("|---|---|---|")
    print(f"| zoo (latent cache, absorbed up-projections) | {zoo_bytes:,.0f} | {ms['zoo']:.1f} |")
    print(f"| transformers DynamicCache | {hf_bytes:,.0f} ({hf_bytes / zoo_bytes:.2f}x the zoo's) | "
          f"{ms['transformers']:.1f} ({ms['transformers'] / ms['zoo']:.2f}x the zoo's) |")
    print(f"| a per-head K/V cache of this model | {per_head:,.0f} ({per_head / zoo_bytes:.2f}x the zoo's) | |")


if __name__ == "__main__":
    main()
