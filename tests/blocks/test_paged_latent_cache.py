"""The paged latent cache: latent attention's packed forward pass over blocks of latents and rotary keys, checked
against the plain forward pass of each sequence alone, absorbed (decode rows, short chunks) and expanded (a long
prefill chunk)."""

from __future__ import annotations

import pytest
import torch

import blocks
from blocks.latent_attention import MultiHeadLatentAttention
from blocks.paged_cache import PagedBatch, PagedLayerCache
from blocks.paged_latent_cache import PagedLatentCache
from models import DecoderLM
from tests.blocks.paged_harness import packed_steps


def test_paged_latent_cache_is_a_registered_kv_cache_kind() -> None:
    cache = blocks.build("kv_cache", "paged_latent", n_blocks=4, block_size=2)
    assert isinstance(cache, PagedLatentCache) and cache.nbytes == 0 and cache.block_nbytes() == 0
    assert MultiHeadLatentAttention.paged_cache_kind == "paged_latent"


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM.from_preset("deepseek_v2-tiny", dropout=0.0).eval()


def test_packed_chunks_and_decode_rows_match_each_sequence_alone(model: DecoderLM,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-token chunk (expanded: 40 queries cost more absorbed), short chunks and one-token rows (absorbed) over
    non-contiguous blocks of 4: every kept logit equals the plain forward pass of its sequence."""
    attn = model.layers[0].self_attn
    assert not attn.absorbs(40) and attn.absorbs(7)
    paths = []
    for name in ("_absorbed", "_expanded"):
        original = getattr(MultiHeadLatentAttention, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            paths.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(MultiHeadLatentAttention, name, spy)
    bs = 4
    caches = [PagedLayerCache(64, bs, layer.self_attn.paged_cache_kind) for layer in model.layers]
    seqs = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (41, 5, 11)]
    with torch.no_grad():
        got, tables = packed_steps(model, caches, seqs, [[(0, 40), (1, 5), (2, 1)], [(0, 1), (2, 9)], [(2, 1)]], bs)
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    want = [ref[0][39], ref[1][4], ref[2][0], ref[0][40], ref[2][9], ref[2][10]]
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
    assert {"_absorbed", "_expanded"} <= set(paths)
    pool = caches[0].self_attn
    # One block: 4 positions of the latent (kv_lora_rank 32) and the rotary key (d_rope 8), float32.
    assert pool.v is None and pool.k.shape[0] == 1 and pool.k.shape[2:] == (bs, 32 + 8)
    assert pool.block_nbytes() == bs * (32 + 8) * 4
    pool.scrub(torch.tensor([tables[2][0]]))
    assert not pool.k[0, tables[2][0]].any() and pool.k[0, tables[2][1]].any()


def test_paged_latent_cache_errors(model: DecoderLM) -> None:
    cache = PagedLatentCache(4, 2)
    with pytest.raises(ValueError, match="needs its PagedBatch"):
        cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 2))
    cache.batch = PagedBatch([(2, 2, [0])], 2)
    with pytest.raises(ValueError, match=r"packed latents \(1, 1, T=2, r\)"):
        cache.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 2))
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="rows of 6 numbers, got 7"):
        cache.update(torch.zeros(1, 1, 2, 5), torch.zeros(1, 1, 2, 2))
    caches = [PagedLayerCache(4, 4, "paged_latent") for _ in model.layers]
    batch = PagedBatch([(3, 3, [0])], 4)
    for layer_cache in caches:
        layer_cache.self_attn.batch = batch
    with pytest.raises(NotImplementedError, match="does not return attention weights"):
        model(torch.tensor([[5, 6, 7]]), positions=batch.positions[None], cache=caches, output_attentions=True)
