"""Iteration-level scheduling (Yu et al. 2022, "Orca", §4.2) over a paged cache (Kwon et al. 2023, §4.5).

Every step the scheduler picks which sequences run and how many of their tokens: each sequence catches up from the
tokens whose keys/values are cached (``num_computed``) to all of its tokens — a prompt in chunks under the token
budget, then one token per decode step — so prefill chunks and decode rows share one forward pass. Running
sequences come first, in arrival order; waiting ones join while the token budget, ``max_num_seqs`` and free blocks
allow, reusing cached blocks of their prefix. When a running sequence needs a block and none is free, the latest
arrival is preempted: its blocks are released and it waits at the front of the queue to be recomputed (its
tokens and its random generator are kept, so its output does not change). A waiting sequence starts only when
``admit`` allows it (the engine's LoRA slots: its adapter must be resident), and its prefix-cache keys start from
its request's ``cache_salt`` (its adapter's), so cached blocks are shared only between requests of one adapter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from blocks.paged_cache import BlockAllocator

from .requests import Sequence


class Scheduler:
    """Waiting and running sequences, and the blocks they hold.

    Args:
        allocator: the cache's block allocator.
        max_num_seqs: sequences in one step at most.
        max_num_batched_tokens: tokens in one step at most (the token budget).
        prefix_caching: commit full blocks under the hash of their prefix and reuse them.
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = True) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # May this waiting sequence start now? (the engine's LoRA slots: its adapter must be resident)
        self.admit: Callable[[Sequence], bool] | None = None
        self.prefix_hits = 0  # tokens taken from the prefix cache

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The sequences of the next step, each with the number of its tokens to compute (>= 1).

        Returns:
            ``(sequence, n_tokens)`` pairs: running sequences first, then waiting ones that joined.

        Raises:
            RuntimeError: the first chunk of a waiting sequence does not fit in an empty cache.
        """
        budget = self.budget
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # ``seq`` preempted itself: it was the last running one
        # New sequences join only when nothing had to be preempted (the cache is not short of blocks).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.admit is not None and not self.admit(seq):
                break  # it waits, first in the queue, until what it needs is free
            if not seq.block_table:
                self._hit_prefix(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n):
                self.release(seq)  # it stays first in the queue, holding nothing
                if not self.running:  # every block is free: check_request rules this out
                    raise RuntimeError(f"the paged cache cannot hold the first chunk of request {seq.request_id}")
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def computed(self, seq: Sequence, n: int) -> None:
        """Record that ``n`` more tokens of ``seq`` are cached; commit the blocks they fill.

        Args:
            seq: the sequence.
            n: tokens computed in the last step.
        """
        seq.num_computed += n
        if not self.prefix_caching:
            return
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            j = len(seq.block_hashes)
            key = BlockAllocator.block_hash(seq.block_hashes[-1] if j else seq.spec.cache_salt,
                                            seq.tokens[j * bs:(j + 1) * bs])
            self.allocator.commit(seq.block_table[j], key)
            seq.block_hashes.append(key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (another sample of ``parent``'s prompt) sharing ``parent``'s full blocks; the partial
        last block is recomputed by the child (no block is ever written by two sequences).

        Args:
            parent: the running sample.
            child: the new sample.
        """
        full = parent.num_computed // self.block_size
        child.block_table = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        for block in child.block_table:
            self.allocator.share(block)
        child.num_computed = full * self.block_size
        self.running.append(child)

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and put it first in the waiting queue (recomputed when it runs again).

        Args:
            seq: a running sequence.
        """
        self.running.remove(seq)
        self.release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks; nothing of it stays cached except through the prefix cache.

        Args:
            seq: the sequence.
        """
        self.allocator.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and release its blocks.

        Args:
            seq: the sequence.
        """
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def _hit_prefix(self, seq: Sequence) -> None:
        """Take the cached blocks of ``seq``'s longest cached prefix of full blocks, leaving at least its last
        token to compute (its logits choose the next token, and no shared block is written)."""
        if not self.prefix_caching:
            return
        bs, parent = self.block_size, seq.spec.cache_salt
        for j in range((len(seq.tokens) - 1) // bs):
            key = BlockAllocator.block_hash(parent, seq.tokens[j * bs:(j + 1) * bs])
            block = self.allocator.lookup(key)
            if block is None:
                break
            seq.block_table.append(block)
            seq.block_hashes.append(key)
            parent = key
        seq.num_computed = len(seq.block_table) * bs
        self.prefix_hits += seq.num_computed

    def _reserve(self, seq: Sequence, n_tokens: int) -> bool:
        """Allocate blocks until ``seq`` holds ``n_tokens`` positions; False (nothing allocated) if too few are
        free."""
        needed = -(-n_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(needed))
        return True
