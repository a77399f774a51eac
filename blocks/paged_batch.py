"""One packed forward pass over a paged cache (``blocks.paged_cache``): where each row's new tokens sit, the pool slot
each new key is written to, and the groups of rows attended together, with their block tables and masks.

Everything is built with tensor operations over all rows at once (no Python loop over positions): a step of 60
decoding rows and a 500-token prefill chunk costs a few dozen small tensor operations, shared by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .paged_attention import RaggedRows

#: What one more attention group costs beyond its keys, in gathered key positions (the Python and kernel-launch
#: time of one more gather and backend call per layer, measured on the CPU, expressed as copied positions).
GROUP_COST = 2048
#: The values of ``PagedBatch``'s ``decode``.
DECODE_MODES = ("split", "one", "ragged")


def split_by_length(members: list[tuple[int, int, int, Sequence[int]]], block_size: int,
                    max_groups: int = 4) -> list[list[tuple[int, int, int, Sequence[int]]]]:
    """Decoding rows in groups of similar context length: a group's keys are padded to its longest row, so rows
    of 20 and 300 positions in one group gather and attend 600 positions instead of 320. Sorted by length, the
    rows are cut (dynamic programming) where ``Σ rows · longest blocks · block_size + GROUP_COST`` per group is
    least, into at most ``max_groups`` groups. Rows needing the same number of blocks cost the same in any group
    of them, so cuts fall only between distinct block counts (a cut inside them never lowers the cost).

    Args:
        members: the decoding rows, each ``(row index, n_query, n_context, block_table)``.
        block_size: positions per block.
        max_groups: the most groups to make.

    Returns:
        The groups, each a list of members, from the shortest rows to the longest.
    """
    if len(members) < 2:
        return [members]
    rows = sorted(members, key=lambda m: m[2])
    blocks = [-(-m[2] // block_size) * block_size for m in rows]
    ends = [i + 1 for i in range(len(rows)) if i + 1 == len(rows) or blocks[i + 1] != blocks[i]]  # run ends
    n = len(ends)
    # best[j][i]: least cost of the first ends[i - 1] rows in j groups; cut[j][i]: the run its last group starts at.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    starts = [0, *ends]
    for j in range(1, max_groups + 1):
        for i in range(1, n + 1):
            longest = blocks[ends[i - 1] - 1]
            for s in range(i):
                cost = best[j - 1][s] + (ends[i - 1] - starts[s]) * longest + GROUP_COST
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, s
    j = min(range(1, max_groups + 1), key=lambda g: best[g][n])
    groups, end = [], n
    while j:
        s = cut[j][end]
        groups.append(rows[starts[s]:starts[end]])
        end, j = s, j - 1
    return groups[::-1]


@dataclass
class AttentionGroup:
    """Rows attended together: their queries padded to ``Lq``, their keys to ``K = n_blocks · block_size``.

    Attributes:
        q_index: ``(G, Lq)`` long, the packed index of each query (0 where padded).
        valid: ``(G, Lq)`` bool, True at real queries.
        flat: ``(n_valid,)`` long, ``q_index[valid]``.
        tables: ``(G, nb)`` long block ids (padded with the row's first block: read but masked).
        q_pos: ``(G, Lq)`` long positions of the queries.
        masks: the masks built so far, by ``(window, rep)``.
        dense: every query is real (no padding): no boolean indexing (static shapes when compiled).
        gathers: the gather indices built so far, by ``(heads, pool blocks)``.
        row: ``(start, n_query, n_context)`` of a group holding one row of several new tokens (a prefill chunk),
            which attends causally over its own ``n_context`` keys with no padding; else None.
    """

    q_index: Tensor  # (G, Lq) long, the packed index of each query (0 where padded)
    valid: Tensor  # (G, Lq) bool
    flat: Tensor  # (n_valid,) long, q_index[valid]
    tables: Tensor  # (G, nb) long block ids (padded with the row's first block: read but masked)
    q_pos: Tensor  # (G, Lq) long positions of the queries
    masks: dict[tuple[int | None, int], Tensor] = field(default_factory=dict)  # (window, rep) -> mask
    dense: bool = False  # every query is real (no padding): no boolean indexing (static shapes when compiled)
    gathers: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (heads, pool blocks) -> flat index
    #: ``(start, n_query, n_context)`` of a group holding one row of several new tokens (a prefill chunk): it
    #: attends causally over its own ``n_context`` keys, with no padding.
    row: tuple[int, int, int] | None = None

    def mask(self, window: int | None, block_size: int, rep: int = 1) -> Tensor:
        """``(G, 1, rep·Lq, K)`` bool, True = may attend: keys at or before each query's position (and within
        ``window``), each query row repeated for the ``rep`` query heads ``PagedKVCache.attend`` folds into the query
        axis; broadcast over the key/value heads.

        Args:
            window: a sliding window (keys fewer than ``window`` positions back only), or None.
            block_size: positions per block.
            rep: query heads per key/value head.

        Returns:
            The mask, built once per ``(window, rep)`` and kept.

        Shapes: -> ``(G, 1, rep·Lq, K)`` bool.
        """
        key = (window, rep)
        if key not in self.masks:
            keys = torch.arange(self.tables.shape[1] * block_size, device=self.q_pos.device)
            distance = self.q_pos[:, :, None] - keys  # (G, Lq, K)
            allowed = (distance >= 0) & self.valid[:, :, None]
            if window is not None:
                allowed &= distance < window
            g, lq, k = allowed.shape
            self.masks[key] = allowed[:, None, None].expand(g, 1, rep, lq, k).reshape(g, 1, rep * lq, k)
        return self.masks[key]

    def gather_index(self, heads: int, pool_blocks: int) -> Tensor:
        """``(G · heads · nb,)`` long: the group's blocks in a pool ``(heads, pool_blocks, ...)`` viewed as
        ``(heads · pool_blocks, ...)`` — one ``index_select`` along dim 0 (contiguous rows copied whole, several
        times faster on the CPU than selecting along dim 1) gives ``(G, heads, nb, ...)``.

        Args:
            heads: the pool's key/value heads.
            pool_blocks: the pool's number of blocks.

        Returns:
            The flat index, built once per ``(heads, pool_blocks)`` and kept.

        Shapes: -> ``(G · heads · nb,)`` long.
        """
        key = (heads, pool_blocks)
        if key not in self.gathers:
            offsets = torch.arange(heads, device=self.tables.device)[:, None] * pool_blocks  # (heads, 1)
            self.gathers[key] = (offsets[None] + self.tables[:, None]).flatten()  # (G, heads, nb)
        return self.gathers[key]


class PagedBatch:
    """What one packed forward pass over a paged cache needs, shared by every layer.

    Args:
        rows: per row ``(n_query, n_context, block_table)``: the row's new tokens (consecutive in the packed
            sequence, rows in order), the positions it holds after this step (cached + new), and the block ids
            holding positions ``0 .. n_context - 1``.
        block_size: positions per block.
        device: where the index tensors live.
        decode: how the rows of one new token (decoding rows) are attended: ``"split"`` in groups of similar
            context length (``split_by_length``), each padded to its longest row; ``"one"`` in one such group;
            ``"ragged"`` without padding, as ``RaggedRows`` (``blocks.paged_attention``).
        capacity: fixes ``max_block`` (a pool allocated whole, so a compiled step never grows it).

    Attributes:
        positions: ``(T,)`` long, the position of each packed token.
        slots: ``(T,)`` long, the pool slot (``block · block_size + offset``) each new key/value is written to.
        last: ``(n_rows,)`` long, the packed index of each row's last token.
        max_block: the highest block id read or written, plus 1.
        groups: the ``AttentionGroup`` of the decoding rows (``decode="split"`` or ``"one"``) and of the other rows.
        ragged: the decoding rows as ``RaggedRows`` (``decode="ragged"`` and any decoding row), else None.

    Raises:
        ValueError: a row with ``n_query`` outside ``[1, n_context]`` or too few blocks, or an unknown ``decode``.
    """

    def __init__(self, rows: Sequence[tuple[int, int, Sequence[int]]], block_size: int,
                 device: torch.device | str = "cpu", *, decode: str = "split", capacity: int | None = None) -> None:
        if not rows:
            raise ValueError("a paged batch needs at least one row")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        for n_query, n_context, table in rows:
            if not 1 <= n_query <= n_context or len(table) * block_size < n_context:
                raise ValueError(
                    f"a row needs 1 <= n_query <= n_context <= len(table) * block_size, got n_query={n_query}, "
                    f"n_context={n_context}, {len(table)} blocks of {block_size}"
                )
        self.block_size = block_size
        n_query = torch.tensor([r[0] for r in rows], dtype=torch.long)
        n_context = torch.tensor([r[1] for r in rows], dtype=torch.long)
        used = [-(-r[1] // block_size) for r in rows]
        width = max(used)
        # (R, width) block tables, each padded with its row's first block: padding is read (and masked), never
        # another request's block — keys masked out still enter the products, so a NaN there would reach this row.
        tables = torch.tensor([[*t[:u], *[t[0]] * (width - u)] for (_, _, t), u in zip(rows, used, strict=True)],
                              dtype=torch.long)
        ends = n_query.cumsum(0)
        starts = ends - n_query
        self.n_tokens = int(ends[-1])
        row_of = torch.repeat_interleave(torch.arange(len(rows)), n_query)  # (T,) the row of each packed token
        positions = (n_context - n_query)[row_of] + torch.arange(self.n_tokens) - starts[row_of]
        slots = tables[row_of, positions // block_size] * block_size + positions % block_size
        self.positions, self.slots, self.last = positions.to(device), slots.to(device), (ends - 1).to(device)
        # The tables hold only used blocks (padding repeats a row's first): their largest id is the largest used.
        self.max_block = capacity if capacity is not None else int(tables.max()) + 1
        one_token = [(i, 1, r[1], r[2]) for i, r in enumerate(rows) if r[0] == 1]
        kinds = [[m[0] for m in g] for g in split_by_length(one_token, block_size)] if decode == "split" else \
            [[m[0] for m in one_token]] if decode == "one" else []
        kinds += [[i] for i, r in enumerate(rows) if r[0] != 1]  # a row of several new tokens: a group of its own
        args = (starts, n_query, n_context, tables, device)
        self.groups = [self._group(members, *args) for members in kinds if members]
        self.ragged = None
        if decode == "ragged" and one_token:
            self.ragged = self._ragged([m[0] for m in one_token], starts, n_context, tables, used, device,
                                       whole=len(one_token) == len(rows))

    @classmethod
    def of_decoding_rows(cls, positions: Tensor, slots: Tensor, last: Tensor, ragged: RaggedRows,
                         block_size: int) -> PagedBatch:
        """A batch of one-token rows only, from its tensors (what ``decode="ragged"`` builds when every row decodes):
        for a traced step that takes them as inputs (``serving.aot_export``).

        Args:
            positions: ``(R,)`` long, each row's position.
            slots: ``(R,)`` long, the pool slot each row's new key/value is written to.
            last: ``(R,)`` long, the packed index of each row.
            ragged: the rows as ``RaggedRows`` (``whole``).
            block_size: positions per block.

        Returns:
            The batch (``max_block`` 0: the pools were grown before).

        Shapes: positions, slots, last ``(R,)``.
        """
        batch = cls.__new__(cls)
        batch.block_size, batch.n_tokens, batch.max_block, batch.groups = block_size, positions.shape[0], 0, []
        batch.positions, batch.slots, batch.last, batch.ragged = positions, slots, last, ragged
        return batch

    def _ragged(self, members: list[int], starts: Tensor, n_context: Tensor, tables: Tensor, used: list[int],
                device: torch.device | str, whole: bool) -> RaggedRows:
        index = torch.tensor(members, dtype=torch.long)
        n_blocks = torch.tensor([used[i] for i in members], dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(len(members)), n_blocks)  # (E,)
        j = torch.arange(row.numel()) - (n_blocks.cumsum(0) - n_blocks)[row]  # each entry's place in its row
        layout = torch.full((len(members), int(n_blocks.max())), row.numel(), dtype=torch.long)
        layout[row, j] = torch.arange(row.numel())
        return RaggedRows(starts[index].to(device), (n_context[index] - 1).to(device), tables[index][row, j].to(device),
                          row.to(device), (j * self.block_size).to(device), layout.to(device), whole=whole)

    def _group(self, members: list[int], starts: Tensor, n_query: Tensor, n_context: Tensor, tables: Tensor,
               device: torch.device | str) -> AttentionGroup:
        index = torch.tensor(members, dtype=torch.long)
        nq, nc = n_query[index], n_context[index]
        lq = int(nq.max())
        nb = -(-int(nc.max()) // self.block_size)
        offsets = torch.arange(lq)
        valid = offsets < nq[:, None]  # (G, Lq)
        q_index = torch.where(valid, starts[index][:, None] + offsets, 0)
        q_pos = torch.where(valid, (nc - nq)[:, None] + offsets, 0)
        dense = bool(valid.all())
        flat = q_index.flatten() if dense else q_index[valid]
        row = (int(starts[members[0]]), lq, int(nc[0])) if lq > 1 else None
        return AttentionGroup(q_index.to(device), valid.to(device), flat.to(device),
                              tables[index, :nb].to(device), q_pos.to(device), dense=dense, row=row)
