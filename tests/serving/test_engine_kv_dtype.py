"""``Engine(kv_cache_dtype=...)``: float16 pools under a float32 model (llama.cpp's default cache, vLLM's
``kv_cache_dtype``). Keys and values are rounded when written and read back into float32, so each request's tokens
and log-probabilities are those of one full forward pass whose attention sees float16-rounded keys and values
(``RoundedKeys``, an independent contiguous cache), whatever else is in the batch; the cache takes half the bytes;
the graphs take float16 pools; bad values are refused."""

from __future__ import annotations

import pytest
import torch

import blocks
from blocks.kv_cache import KVCache
from blocks.paged_cache import PagedBatch, PagedKVCache
from models import DecoderLM
from models.generation import compiled
from serving import Engine, cli
from serving.aot_export import export_step
from serving.runner import RaggedAttention
from serving.startup import startup_line

from .test_engine import MAX_TOKENS, prompts, run_staggered, tiny_model

ORDER = [3, 0, 1, 4]


class RoundedKeys(KVCache):
    """A contiguous cache whose keys and values are rounded to float16 and back (what a float16 pool holds)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().update(k.half().float(), v.half().float())


class LayerCache:
    cross_attn = None

    def __init__(self, max_len: int) -> None:
        self.self_attn = RoundedKeys(max_len)


def log_probs(model: DecoderLM, prompt: list[int], tokens: list[int], rounded: bool) -> torch.Tensor:
    """Each new token's log-softmax row from one forward pass over prompt + tokens."""
    ids = torch.tensor([prompt + tokens])
    cache = [LayerCache(ids.shape[1]) for _ in model.layers] if rounded else None
    with torch.no_grad():
        return model(ids, cache=cache).logits[0, len(prompt) - 1: -1].log_softmax(-1)


def staggered(engine: Engine, ps: list[list[int]]) -> list:
    arrivals = {0: [3, 0], 2: [1], 5: [4]}
    return run_staggered(engine, {step: [(ps[i], dict(max_tokens=MAX_TOKENS[i], logprobs=3)) for i in items]
                                  for step, items in arrivals.items()})


@pytest.mark.parametrize("compile_mode", [False, "attention", True])
def test_a_float16_cache_gives_a_forward_pass_over_rounded_keys(monkeypatch: pytest.MonkeyPatch,
                                                               compile_mode: bool | str) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model = tiny_model("qwen3-tiny")  # GQA, q/k norms
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, kv_cache_dtype="float16",
                    compile=compile_mode)
    outputs = staggered(engine, ps)
    assert {cache.self_attn.k.dtype for cache in engine.runner.caches} == {torch.float16}
    off_rounded, off_float32, distinct = [], [], set()
    for i, out in zip(ORDER, outputs, strict=True):
        want = log_probs(model, ps[i], out.token_ids, rounded=True)
        assert out.token_ids == want.argmax(-1).tolist()[: len(out.token_ids)], i
        chosen = torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        # (float32 noise of ~1e-7 in a key can flip its float16 rounding: a few 1e-4 here and there)
        torch.testing.assert_close(got, want[chosen], rtol=0, atol=1e-3)
        off_rounded.append((got - want[chosen]).abs())
        off_float32.append((got - log_probs(model, ps[i], out.token_ids, rounded=False)[chosen]).abs())
        distinct |= set(out.token_ids)
    # The rounding is real: a float32 cache's log-probabilities are much further off.
    assert torch.cat(off_rounded).mean() * 5 < torch.cat(off_float32).mean()
    assert len(distinct) > 10
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_a_float16_cache_takes_half_the_bytes() -> None:
    model = tiny_model("llama-tiny")
    engines = {dtype: Engine(model, block_size=4, kv_cache_bytes=1 << 20, kv_cache_dtype=dtype)
               for dtype in ("auto", torch.float16)}
    assert engines[torch.float16].allocator.n_blocks == 2 * engines["auto"].allocator.n_blocks
    for engine in engines.values():
        engine.generate([prompts()[2]], max_tokens=5)
    assert engines[torch.float16].runner.nbytes * 2 == engines["auto"].runner.nbytes > 0
    assert engines[torch.float16].runner.block_nbytes() * 2 == engines["auto"].runner.block_nbytes()


def test_the_compiled_ragged_attention_reads_float16_pools() -> None:
    """Inductor's ``ragged_decode_attention`` over float16 pools equals the gather + sdpa path over the same pools
    read as float32 (GQA, a soft-cap, a window, sinks)."""
    torch.manual_seed(0)
    bs, n_kv, n_heads = 4, 2, 4
    cache = PagedKVCache(32, bs, dtype=torch.float16)
    cache.k, cache.v = torch.randn(n_kv, 32, bs, 8).half(), torch.randn(n_kv, 32, bs, 8).half()
    reference = PagedKVCache(32, bs)
    reference.k, reference.v = cache.k.float(), cache.v.float()
    rows = [(1, 13, [3, 0, 7, 9]), (1, 6, [5, 11]), (1, 7, [1, 2])]
    q = torch.randn(1, n_heads, 3, 8)
    kwargs = dict(scale=0.3, softcap=20.0, window=6, sinks=torch.randn(n_heads))
    reference.batch = PagedBatch(rows, bs)
    want = reference.attend(q, blocks.get("attention_backend", "math"), **kwargs)
    cache.batch, cache.ragged_attention = PagedBatch(rows, bs, decode="ragged"), RaggedAttention()
    got = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    cache.batch = PagedBatch(rows, bs)  # the eager gather path reads them back into float32 too
    torch.testing.assert_close(cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs), want, rtol=0,
                               atol=1e-5)


def test_the_exported_step_takes_float16_pools() -> None:
    model = DecoderLM.from_preset("qwen3-tiny", n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_head=8, d_ff=32,
                                  vocab_size=97).eval()
    program = export_step(model, 4, "single", torch.float16)
    pools = [node.meta["val"].dtype for node in program.graph.nodes
             if node.op == "placeholder" and node.meta["val"].dim() == 4]
    assert pools == [torch.float16, torch.float16]


@pytest.mark.parametrize("value", ["int8", "fp8", torch.int8, 16, None])
def test_an_unknown_kv_cache_dtype_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of 'auto', .*got {value!r}"):
        Engine(tiny_model("llama-tiny"), kv_cache_dtype=value)


def test_a_latent_attention_cache_keeps_the_model_dtype() -> None:
    model = tiny_model("deepseek_v2-tiny")
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='float16': a latent-attention model's cache"):
        Engine(model, kv_cache_dtype="float16")
    Engine(model, kv_cache_dtype="float32")  # the model's own dtype is fine
    with pytest.raises(NotImplementedError, match="keeps the model's dtype"):
        blocks.get("kv_cache", "paged_latent")(4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be a float torch.dtype or None, got torch.int8"):
        PagedKVCache(4, 4, dtype=torch.int8)


def test_zoo_serve_takes_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.parser().parse_args(["serve", "some-model", "--kv-cache-dtype", "float16", "--kv-blocks", "8"])
    assert args.kv_cache_dtype == "float16"
    assert cli.parser().parse_args(["serve", "some-model"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["serve", "some-model", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    model = tiny_model("llama-tiny")
    limits = dict(max_num_seqs=2, num_blocks=8, block_size=4, kv_cache_bytes=None, max_model_len=64, compile=False)
    half = startup_line("m", model, args, {**limits, "kv_cache_dtype": "float16"})
    full = startup_line("m", model, args, {**limits, "kv_cache_dtype": "auto"})
    per_block = 4 * sum(layer.self_attn.n_kv_heads * 2 * layer.self_attn.d_head for layer in model.layers)
    assert f"KV cache 8 blocks of 4 positions ({8 * per_block * 2 / 2**20:.1f} MiB, float16)" in half
    assert f"({8 * per_block * 4 / 2**20:.1f} MiB)" in full
