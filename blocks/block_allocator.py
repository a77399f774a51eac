"""The block allocator of a paged key/value cache (Kwon et al. 2023, "PagedAttention", §4.2–4.3): reference counts,
a free list handing out the lowest ids first, and a prefix cache of full blocks with LRU eviction.

``blocks.paged_cache`` holds the pools the block ids index and re-exports ``BlockAllocator``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence


class BlockAllocator:
    """Block ids of a paged cache: reference counts, a free list and a prefix cache of full blocks.

    A full block can be *committed* under the hash of its tokens chained with the hash of the blocks before it
    (``block_hash``): a later request with the same prefix acquires it instead of recomputing it. A block whose
    count drops to 0 is free; if it is committed it keeps its contents and stays findable until it is reused —
    uncommitted free blocks are handed out first, then committed ones least recently freed first (LRU eviction).

    Args:
        n_blocks: blocks in the cache (>= 1).
        block_size: positions per block (>= 1).

    Raises:
        ValueError: ``n_blocks`` or ``block_size`` is not a positive integer.
    """

    def __init__(self, n_blocks: int, block_size: int) -> None:
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self._plain: list[int] = list(range(n_blocks))  # a heap: the lowest free id first keeps the pool small
        self._lru: OrderedDict[int, None] = OrderedDict()  # free committed blocks, least recently freed first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}

    @staticmethod
    def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """The prefix-cache key of a full block: SHA-256 of the previous block's key and this block's tokens.

        Args:
            parent: the previous block's key, or None for the first block.
            tokens: the block's token ids.

        Returns:
            The 32-byte digest.
        """
        digest = hashlib.sha256(parent or b"")
        digest.update(b",".join(str(int(t)).encode() for t in tokens))
        return digest.digest()

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free uncommitted ones and evictable cached ones)."""
        return len(self._plain) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Committed blocks (in use or free) that a prefix can hit."""
        return len(self._by_hash)

    def cached_free_blocks(self) -> list[int]:
        """Committed blocks with no reference, least recently freed first.

        Returns:
            Their ids.
        """
        return list(self._lru)

    def allocate(self) -> int:
        """A free block with one reference; evicts the least recently freed cached block if no plain one is free.

        Returns:
            The block id.

        Raises:
            RuntimeError: no block is free (callers check ``num_free`` first).
        """
        if self._plain:
            block = heapq.heappop(self._plain)
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise RuntimeError(f"the paged cache has no free block (all {self.n_blocks} are in use)")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference to a block in use (a sample forked from a request shares its full blocks).

        Args:
            block: the block id.

        Raises:
            ValueError: the block is free.
        """
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is free; only a block in use can be shared")
        self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 are free. The last block of a table is released
        first, so the blocks at the start of a prefix — the ones most often shared — are evicted last.

        Args:
            blocks: the block ids (a block table).

        Raises:
            ValueError: a block is already free.
        """
        for block in reversed(blocks):
            if self.refs[block] < 1:
                raise ValueError(f"block {block} is already free")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    heapq.heappush(self._plain, block)

    def forget(self, block: int) -> None:
        """Drop a free block from the prefix cache (its contents must not be found again: a request whose logits
        were NaN wrote it).

        Args:
            block: the block id.

        Raises:
            ValueError: the block is in use.
        """
        if self.refs[block] != 0:
            raise ValueError(f"block {block} is in use; only a free block can be forgotten")
        key = self._hash_of.pop(block, None)
        if key is not None:
            del self._by_hash[key]
            del self._lru[block]
            heapq.heappush(self._plain, block)

    def lookup(self, key: bytes) -> int | None:
        """Take a reference to the committed block of ``key``, or return None on a miss.

        Args:
            key: the prefix-cache key (``block_hash``).

        Returns:
            The block id, or None.
        """
        block = self._by_hash.get(key)
        if block is None:
            return None
        if self.refs[block] == 0:
            del self._lru[block]
        self.refs[block] += 1
        return block

    def commit(self, block: int, key: bytes) -> None:
        """Make a full block in use findable under ``key`` (a no-op if that key or this block is taken).

        Args:
            block: a block in use, its positions all written.
            key: its ``block_hash`` (the hash of its tokens chained with the blocks before it).

        Raises:
            ValueError: the block is free (a free block's contents may be overwritten at any time).
        """
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is free; only a block in use can be committed")
        if key not in self._by_hash and block not in self._hash_of:
            self._by_hash[key] = block
            self._hash_of[block] = key
