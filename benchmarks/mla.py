"""Decoding a DeepSeek-shaped latent-attention model: KV-cache bytes per token and ms per token, zoo against
``transformers`` on the same weights and prompt.

``python -m benchmarks.mla`` builds a ``transformers`` ``DeepseekV2ForCausalLM`` with DeepSeek-V2-Lite's attention
(width 2048, 16 heads, ``kv_lora_rank`` 512, rotary 64 + 128 other query/key dims, values 128, no query
compression) and a reduced body (``--layers`` layers, the first dense, 8 routed experts top-2 + 2 shared, vocabulary
16000), converts it (``models.convert.from_transformers``), checks the greedy tokens are equal, then times greedy
``generate`` of ``--new`` tokens after a ``--prompt``-token prompt (batch 1, fp32, CPU), competitors interleaved,
medians of ``--repeats``, process CPU time (one thread by default). ms/token = (time of ``--new`` tokens − time of
1 token) / (``--new`` − 1): decoding steps only, the prefill cancels out.

Cache bytes per token (all layers, one sequence) are read from the caches themselves after generation: the zoo's
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


def timed(run: Callable[[], object]) -> float:
    """Process CPU seconds of ``run()``: with one thread the work done, time spent descheduled on a shared machine
    left out (wall time moved by a third between runs there)."""
    start = time.process_time()
    run()
    return time.process_time() - start


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

    def hf_generate(n: int) -> object:
        with torch.inference_mode():
            return hf.generate(input_ids=prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)

    def zoo_generate(n: int) -> torch.Tensor:
        return zoo.generate(prompt, max_new_tokens=n, eos_token_id=None, pad_token_id=0)

    hf_out = hf_generate(args.new)
    zoo_tokens = zoo_generate(args.new)
    same = torch.equal(hf_out.sequences, zoo_tokens)
    length = hf_out.sequences.shape[1] - 1  # the last token is chosen, never fed back
    hf_cache = hf_out.past_key_values
    hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in hf_cache.layers) / length
    caches = new_caches(zoo.layers, length)
    with torch.inference_mode():
        zoo(zoo_tokens[:, :length], cache=caches)
    zoo_bytes = sum(c.self_attn.bytes_per_token() for c in caches)
    c = zoo.config
    per_head = c.n_layers * c.n_heads * (c.d_head + c.d_value) * 4

    runs = {"zoo": zoo_generate, "transformers": hf_generate}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            long, short = timed(lambda run=run: run(args.new)), timed(lambda run=run: run(1))
            times[name].append((long - short) / (args.new - 1))
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
