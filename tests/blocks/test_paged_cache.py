"""The paged KV cache: block allocator (reference counts, free list, prefix cache, LRU eviction) and a packed
forward pass over it, checked against the plain forward pass of each sequence alone."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
from blocks import paged_batch
from blocks.paged_cache import GROUP_COST, BlockAllocator, PagedBatch, PagedLayerCache, split_by_length
from models import DecoderLM
from tests.blocks.paged_harness import packed_steps


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is faster, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_paged_cache_is_a_registered_kv_cache_kind() -> None:
    assert blocks.names("kv_cache") == ["contiguous", "latent", "paged", "paged_latent"]
    cache = blocks.build("kv_cache", "paged", n_blocks=4, block_size=2)
    assert isinstance(cache, blocks.PagedKVCache) and cache.nbytes == 0


def test_allocator_hands_out_lowest_ids_and_counts_references() -> None:
    alloc = BlockAllocator(4, 2)
    a, b = alloc.allocate(), alloc.allocate()
    assert (a, b) == (0, 1) and alloc.num_free == 2
    alloc.share(a)
    alloc.release([a, b])
    assert alloc.refs[:2] == [1, 0] and alloc.num_free == 3
    assert alloc.allocate() == 1  # the lowest free id again
    alloc.release([a, 1])
    assert alloc.num_free == 4 and alloc.refs == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="already free"):
        alloc.release([a])
    for _ in range(4):
        alloc.allocate()
    with pytest.raises(RuntimeError, match="no free block"):
        alloc.allocate()


def test_prefix_cache_hits_chained_hashes_and_evicts_least_recently_freed() -> None:
    alloc = BlockAllocator(3, 2)
    first = BlockAllocator.block_hash(None, [1, 2])
    second = BlockAllocator.block_hash(first, [3, 4])
    assert second != BlockAllocator.block_hash(BlockAllocator.block_hash(None, [9, 9]), [3, 4])  # chained
    x, y = alloc.allocate(), alloc.allocate()
    alloc.commit(x, first)
    alloc.commit(y, second)
    assert alloc.lookup(first) == x and alloc.refs[x] == 2  # a hit takes a reference
    alloc.release([x])
    alloc.release([x, y])  # freed last block first: y is evicted before x
    assert alloc.num_free == 3 and alloc.num_cached == 2 and alloc.cached_free_blocks() == [y, x]
    assert alloc.lookup(second) == y and alloc.num_free == 2  # a free cached block is revived
    alloc.release([y])  # y is now the most recently freed
    # Block 2 lies past the pools' capacity (2 blocks): the least recently freed cached block goes first.
    assert alloc.capacity == 2 and alloc.allocate() == x and alloc.num_cached == 1
    assert alloc.lookup(first) is None and alloc.lookup(second) == y
    assert alloc.allocate() == 2 and alloc.capacity == 3  # nothing else free: the pools grow


def test_the_prefix_cache_never_grows_the_pools() -> None:
    """A plain free block within the pools' capacity goes before a cached one; a cached one before growing."""
    alloc = BlockAllocator(16, 2)
    blocks = [alloc.allocate() for _ in range(3)]
    assert blocks == [0, 1, 2] and alloc.capacity == 4  # doubling, as the pools grow
    for i, block in enumerate(blocks[:2]):
        alloc.commit(block, BlockAllocator.block_hash(None, [i, i]))
    alloc.release(blocks)  # 0 and 1 cached, 2 plain
    assert alloc.allocate() == 2 and alloc.allocate() == 3  # plain blocks within the capacity
    assert alloc.allocate() == 1 and alloc.allocate() == 0  # then the cache, least recently freed first
    assert alloc.capacity == 4 and alloc.num_cached == 0
    assert alloc.allocate() == 4 and alloc.capacity == 8  # only now past the capacity


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_allocator_and_cache_reject_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="n_blocks"):
        BlockAllocator(bad, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        blocks.PagedKVCache(2, bad)  # type: ignore[arg-type]


def test_batch_rejects_a_row_its_blocks_cannot_hold() -> None:
    with pytest.raises(ValueError, match="n_context"):
        PagedBatch([(3, 5, [0])], block_size=4)


@pytest.mark.parametrize("preset", ["tiny", "mistral-tiny", "gemma2-tiny", "gpt_neox-tiny", "qwen3-tiny"])
def test_packed_prefill_chunks_and_decode_rows_match_each_sequence_alone(preset: str) -> None:
    """Rows of different lengths, prefill chunks beside one-token rows, over blocks of 4 (windows of 8 span
    blocks): every kept logit equals the plain forward pass of its sequence."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset(preset, dropout=0.0).eval()
    bs = 4
    caches = [PagedLayerCache(64, bs) for _ in model.layers]
    seqs = [torch.randint(3, 1000, (n,)).tolist() for n in (13, 5, 11)]
    with torch.no_grad():
        got, _ = packed_steps(model, caches, seqs, [[(0, 7), (1, 5), (2, 1)], [(0, 6), (2, 9)], [(2, 1)]], bs)
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    want = [ref[0][6], ref[1][4], ref[2][0], ref[0][12], ref[2][9], ref[2][10]]
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
    assert 0 < caches[0].self_attn.nbytes <= 64 * caches[0].self_attn.block_nbytes()


def test_forward_rejects_bad_positions_and_index_logits_with_labels() -> None:
    model = DecoderLM.from_preset("tiny", dropout=0.0).eval()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"positions must be a \(1, 3\) long tensor"):
        model(ids, positions=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be"):
        model(ids, positions=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="logits_to_keep cannot be combined with labels"):
        model(ids, labels=ids, logits_to_keep=torch.tensor([0]))
    with torch.no_grad():
        full = model(ids).logits
        kept = model(ids, positions=torch.arange(3)[None], logits_to_keep=torch.tensor([2, 0])).logits
    torch.testing.assert_close(kept, full[:, [2, 0]])


def test_paged_cache_needs_its_batch() -> None:
    cache = blocks.PagedKVCache(4, 2)
    with pytest.raises(ValueError, match="needs its PagedBatch"):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(NotImplementedError, match="not reordered"):
        PagedLayerCache(4, 2).reorder(torch.tensor([0]))


def _split_cost(groups: list[list[int]], block_size: int, group_cost: int) -> int:
    return sum(len(g) * -(-max(g) // block_size) * block_size + group_cost for g in groups)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=9), block_size=st.sampled_from([1, 4, 16]),
       max_groups=st.integers(1, 4))
def test_decode_rows_split_by_length_at_the_least_cost(lengths: list[int], block_size: int, max_groups: int) -> None:
    members = [(i, 1, n, [0]) for i, n in enumerate(lengths)]
    groups = split_by_length(members, block_size, max_groups)
    assert sorted(m for g in groups for m in g) == sorted(members) and 1 <= len(groups) <= max_groups
    got = _split_cost([[m[2] for m in g] for g in groups], block_size, GROUP_COST)
    # Brute force: every way to cut the sorted lengths into at most max_groups consecutive runs.
    ordered = sorted(lengths)
    best = min(
        _split_cost([ordered[a:b] for a, b in zip((0, *cuts), (*cuts, len(ordered)), strict=True)], block_size,
                    GROUP_COST)
        for k in range(min(max_groups, len(ordered)))
        for cuts in itertools.combinations(range(1, len(ordered)), k)
    )
    assert got == best


def test_decode_rows_in_several_groups_match_each_sequence_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_batch, "GROUP_COST", 0)  # every length its own group
    torch.manual_seed(0)
    model = DecoderLM.from_preset("mistral-tiny", dropout=0.0).eval()  # GQA and a window of 8
    bs = 4
    seqs = [torch.randint(3, 1000, (n,)).tolist() for n in (30, 3, 17, 9)]
    caches = [PagedLayerCache(64, bs) for _ in model.layers]
    alloc = BlockAllocator(64, bs)
    tables = [[alloc.allocate() for _ in range(-(-len(s) // bs))] for s in seqs]
    with torch.no_grad():
        prefill = PagedBatch([(len(s) - 1, len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)], bs)
        for cache in caches:
            cache.self_attn.batch = prefill
        model(torch.tensor([[x for s in seqs for x in s[:-1]]]), positions=prefill.positions[None], cache=caches,
              logits_to_keep=prefill.last)
        decode = PagedBatch([(1, len(s), t) for s, t in zip(seqs, tables, strict=True)], bs)
        assert len(decode.groups) == 4
        for cache in caches:
            cache.self_attn.batch = decode
        got = model(torch.tensor([[s[-1] for s in seqs]]), positions=decode.positions[None], cache=caches,
                    logits_to_keep=decode.last).logits[0]
        want = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_gathers_reuse_one_workspace_and_follow_inference_mode() -> None:
    """The runner's layers share one dict of gather buffers; a buffer made outside inference mode is replaced
    inside it (and an inference buffer outside), and both give the same keys."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset("mistral-tiny", dropout=0.0).eval()
    caches = [PagedLayerCache(16, 4) for _ in model.layers]
    workspace: dict[str, torch.Tensor] = {}
    for cache in caches:
        cache.self_attn.workspace = workspace
    seq = torch.randint(3, 1000, (9,)).tolist()
    batch = PagedBatch([(9, 9, [3, 0, 5])], 4)
    for cache in caches:
        cache.self_attn.batch = batch
    ids, positions = torch.tensor([seq]), batch.positions[None]
    with torch.no_grad():
        first = model(ids, positions=positions, cache=caches).logits
    assert sorted(workspace) == ["k", "v"] and not workspace["k"].is_inference()
    with torch.inference_mode():
        second = model(ids, positions=positions, cache=caches).logits
    assert workspace["k"].is_inference()
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(second, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("n_heads", "softcap", "window", "sinks"),
                         [(4, None, None, False), (8, 30.0, 5, False), (8, None, None, True), (4, 2.0, 6, True)])
@pytest.mark.parametrize("prefill", [False, True])
def test_ragged_decode_rows_equal_the_backends(n_heads: int, softcap: float | None, window: int | None, sinks: bool,
                                               prefill: bool) -> None:
    """One-token rows attended without padding (``decode="ragged"``, ``blocks.paged_attention``) equal the groups
    of the gather + backend path (GQA, soft-caps, windows, sinks), beside a prefill chunk's row or alone."""
    torch.manual_seed(0)
    cache, bs, n_kv = blocks.PagedKVCache(16, 4), 4, 4
    cache.k, cache.v = torch.randn(n_kv, 16, bs, 8), torch.randn(n_kv, 16, bs, 6)
    rows = [(1, 13, [3, 0, 7, 9]), (1, 2, [5]), (1, 7, [1, 2]), (1, 16, [4, 6, 8, 10])]
    rows += [(3, 10, [11, 12, 13])] if prefill else []
    q = torch.randn(1, n_heads, 4 + 3 * prefill, 8)
    kwargs = dict(scale=0.3, softcap=softcap, window=window, sinks=torch.randn(n_heads) if sinks else None)
    cache.batch = PagedBatch(rows, bs)
    want = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
    cache.batch = PagedBatch(rows, bs, decode="ragged")
    assert cache.batch.ragged.whole is not prefill and len(cache.batch.groups) == prefill
    got = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_paged_batch_names_an_unknown_decode_mode() -> None:
    with pytest.raises(ValueError, match="decode must be one of .*got 'padded'"):
        PagedBatch([(1, 1, [0])], 4, decode="padded")


def test_a_growing_pool_keeps_its_blocks_and_zeroes_the_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growth copies the old blocks and zeroes the new ones, whatever the new memory held (NaN here): a masked slot
    of a gathered block is still multiplied, and 0 · NaN = NaN."""
    cache = blocks.PagedKVCache(16, 2)
    empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *size, **kw: empty(self, *size, **kw).fill_(torch.nan))
    k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 5)
    cache.batch = PagedBatch([(2, 2, [1])], 2)  # blocks 0-1: a pool of 2
    cache.update(k, v)
    old_k, old_v = cache.k.clone(), cache.v.clone()
    cache.batch = PagedBatch([(2, 2, [4])], 2)  # block 4: the pool grows to 5 (not 4: at least double)
    cache.update(k, v)
    assert cache.k.shape[1] == 5 and cache.v.shape[1] == 5
    torch.testing.assert_close(cache.k[:, :2], old_k, rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, :2], old_v, rtol=0, atol=0)
    torch.testing.assert_close(cache.k[:, 4], k[0], rtol=0, atol=0)
    assert (cache.k[:, 2:4] == 0).all() and (cache.v[:, 2:4] == 0).all()
