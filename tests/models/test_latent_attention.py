"""Multi-head latent attention (``attention="mla"``) and its latent KV cache.

References: the same model without a cache (expanded keys and values) for cached decoding, the eager loop for
compiled decoding, and the cache's own arithmetic ``(kv_lora_rank + d_rope) · element size · layers``. Agreement with
``transformers``' DeepSeek attention is checked through the families (``tests/models/test_family_deepseek.py``).
"""

from __future__ import annotations

import pytest
import torch

import blocks
from models import DecoderLM
from models.core.stack import new_caches

MLA = {"kv_lora_rank": 24, "q_lora_rank": 16, "d_rope": 8}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


def mla_model(q_lora_rank: int | None = 16, n_layers: int = 2) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM.from_preset(
        "tiny", vocab_size=101, d_model=48, n_heads=3, d_head=20, d_value=12, n_layers=n_layers, dropout=0.0,
        attention="mla", positional="rotary_interleaved", ffn="swiglu", norm="rmsnorm", tie_embeddings=False,
        options={"attention": {**MLA, "q_lora_rank": q_lora_rank}, "positional": {"fraction": 0.4}},
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return mla_model()


@pytest.mark.parametrize("q_lora_rank", [16, None])
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward_and_absorbs_the_up_projections(q_lora_rank: int | None) -> None:
    model = mla_model(q_lora_rank)
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    full = model(ids, attention_mask=mask).logits
    expanded = []  # kv_b_proj calls: the prefill of 4 tokens absorbs too, so none at all with a cache
    hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda *_: expanded.append(1)) for layer in model.layers]
    cache = new_caches(model.layers, 16)
    steps = [model(ids[:, :4], attention_mask=mask[:, :4], cache=cache).logits]
    steps.append(model(ids[:, 4:7], attention_mask=mask[:, :7], cache=cache).logits)  # several queries at once
    for t in range(7, 11):
        steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
    for hook in hooks:
        hook.remove()
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=0)
    assert expanded == []


@torch.no_grad()
def test_the_cache_holds_the_latent_and_the_rotary_key_per_token(model: DecoderLM) -> None:
    cache = new_caches(model.layers, 32)
    assert all(type(c.self_attn) is blocks.LatentKVCache for c in cache)
    model(torch.randint(0, 101, (2, 9)), cache=cache)
    per_token = sum(c.self_attn.bytes_per_token() for c in cache)
    assert per_token == (MLA["kv_lora_rank"] + MLA["d_rope"]) * 4 * len(model.layers)  # fp32
    assert sum(c.self_attn.k.nbytes + c.self_attn.v.nbytes for c in cache) == per_token * 2 * 32  # B=2, 32 slots
    first = cache[0].self_attn
    assert first.latent.shape == (2, 1, 9, MLA["kv_lora_rank"]) and first.rope_key.shape == (2, 1, 9, MLA["d_rope"])


@torch.no_grad()
def test_generate_decodes_as_full_forwards_and_compiled_decoding_agrees(graph_backend: None) -> None:
    model = mla_model(n_layers=1)  # one layer: dynamo's capture time grows with the layers
    ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    # Reference: greedy tokens from full forward passes, no cache at all.
    seq, m = ids, mask
    for _ in range(6):
        token = model(seq, attention_mask=m).logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, token], 1), torch.cat([m, torch.ones_like(token, dtype=torch.bool)], 1)
    assert torch.equal(eager, seq)
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0,
                              compile=True)
    assert torch.equal(compiled, eager)


@torch.no_grad()
def test_an_adapted_kv_up_projection_is_expanded_instead_of_absorbed(model: DecoderLM) -> None:
    adapted = mla_model()
    adapted.add_adapter("lora", target_modules=["kv_b_proj"], r=2)
    for layer in adapted.layers:
        torch.nn.init.normal_(layer.self_attn.kv_b_proj.adapters["default"].lora_B, std=0.1)
    ids = torch.randint(0, 101, (1, 6))
    cache = new_caches(adapted.layers, 8)
    steps = [adapted(ids[:, :5], cache=cache).logits, adapted(ids[:, 5:], cache=cache).logits]
    torch.testing.assert_close(torch.cat(steps, 1), adapted(ids).logits, atol=1e-4, rtol=0)
    assert not torch.allclose(adapted(ids).logits, model(ids).logits, atol=1e-3)


def test_set_attention_backend_reaches_latent_attention(model: DecoderLM) -> None:
    model.set_attention_backend("math")
    assert {layer.self_attn.backend for layer in model.layers} == {"math"}
    model.set_attention_backend("sdpa")


@pytest.mark.parametrize(("options", "named"), [
    ({"kv_lora_rank": 49}, "kv_lora_rank=49"),
    ({"q_lora_rank": 64}, "q_lora_rank=64"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    ({"d_rope": 7}, "d_rope=7"),
    ({"d_rope": 20}, "d_rope=20"),
    ({"n_kv_heads": 1}, "n_kv_heads=1"),
])
def test_bad_shapes_are_refused_by_name(options: dict, named: str) -> None:
    kwargs = {"d_model": 48, "n_heads": 3, "d_head": 20, **MLA, **options}
    with pytest.raises(ValueError, match=named):
        blocks.build("attention", "mla", **kwargs)


def test_a_rotary_encoding_of_another_width_is_refused(model: DecoderLM) -> None:
    attention = model.layers[0].self_attn
    rotary = blocks.build("positional", "rotary", d_model=48, n_heads=3, d_head=20)  # rotates all 20 dims
    x = torch.randn(1, 3, 48)
    with pytest.raises(ValueError, match="rotates 20 dimensions"):
        attention(x, rotary=rotary, positions=torch.arange(3)[None])
    with pytest.raises(ValueError, match="rotary"):
        attention(x)


@torch.no_grad()
def test_speculative_decoding_and_int8_weights_decode_deepseek_models() -> None:
    torch.manual_seed(0)
    target = DecoderLM.from_preset("deepseek_v3-tiny", vocab_size=97).eval()
    draft = DecoderLM.from_preset("deepseek_v2-tiny", vocab_size=97).eval()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    greedy = target.generate(ids, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(target.generate(ids, max_new_tokens=8, eos_token_id=None, draft_model=draft), greedy)
    target.quantize("int8")  # kv_b_proj becomes an Int8Linear: the cached latents are expanded through it
    cache = new_caches(target.layers, 8)
    steps = [target(ids[:, :5], cache=cache).logits, target(ids[:, 5:], cache=cache).logits]
    torch.testing.assert_close(torch.cat(steps, 1), target(ids).logits, atol=1e-4, rtol=0)


def test_latent_attention_refuses_a_per_head_paged_cache(model: DecoderLM) -> None:
    from blocks.paged_cache import PagedBatch, PagedLayerCache

    caches = [PagedLayerCache(4, 4) for _ in model.layers]  # "paged" holds per-head keys; MLA needs "paged_latent"
    batch = PagedBatch([(3, 3, [0])], 4)
    for cache in caches:
        cache.self_attn.batch = batch
    with pytest.raises(NotImplementedError, match="latent attention cannot decode with a PagedKVCache"):
        model(torch.tensor([[5, 6, 7]]), positions=batch.positions[None], cache=caches)


@torch.no_grad()
def test_attention_weights_of_a_cached_step_equal_the_full_forwards_last_row(model: DecoderLM) -> None:
    ids = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(5))
    full = model(ids, output_attentions=True).attentions
    cache = new_caches(model.layers, 8)
    model(ids[:, :5], cache=cache)
    step = model(ids[:, 5:], cache=cache, output_attentions=True).attentions
    for expected, actual in zip(full, step, strict=True):
        assert actual.shape == (2, 3, 1, 6)
        torch.testing.assert_close(actual[:, :, 0], expected[:, :, -1], atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_long_prefill_expands_the_latents_and_decoding_steps_absorb(model: DecoderLM) -> None:
    attention = model.layers[0].self_attn  # r = 24, d_nope = d_value = 12: absorbing pays below 24 queries
    assert attention.absorbs(23) and not attention.absorbs(24)
    ids = torch.randint(0, 101, (1, 31), generator=torch.Generator().manual_seed(6))
    calls = []
    hook = attention.kv_b_proj.register_forward_hook(lambda *_: calls.append(1))
    cache = new_caches(model.layers, 32)
    steps = [model(ids[:, :30], cache=cache).logits]
    prefill_calls = len(calls)
    steps.append(model(ids[:, 30:], cache=cache).logits)
    hook.remove()
    assert (prefill_calls, len(calls)) == (1, 1)
    torch.testing.assert_close(torch.cat(steps, 1), model(ids).logits, atol=1e-4, rtol=0)
