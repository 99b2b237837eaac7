"""BlockManager: the paged KV cache's bookkeeping (no tensors live here).

Blocks hold ``block_size`` tokens. Each has a reference count; a block whose count
drops to zero goes to the back of the queue of freed blocks but keeps its prefix hash,
so a later request with the same prefix can take it back (automatic prefix caching).
Allocations reuse freed blocks from the front of that queue: the least recently freed
block is evicted first (LRU).

A sequence has one block table per KV-cache group (contbatch/engine/kv_cache.py): one for
most models; for Gemma 3, its sliding layers' and its global layers'. All groups take
blocks from the one pool. In a group with a sliding window W, the query at position p
reads keys p - W + 1 .. p only, so once a sequence has computed c tokens, its blocks
wholly before position c - W + 1 are freed (as any freed block: to the queue, keeping
their hash) and their entries become NO_BLOCK. A sequence then holds at most
ceil((W - 1) / block_size) + 1 blocks of such a group for the tokens it decodes, however
long it grows, plus blocks taken ahead (below).

A prefix-cache hit of ``n`` blocks needs, in every group without a window, the cached
blocks 0..n-1, and in every group with one, the cached blocks that hold the W - 1 keys
before position n * block_size (vLLM's rule): the first query after the hit reads no
others. The hit is the longest such ``n``.

Blocks of one request are kept contiguous where the pool allows: the blocks an
allocation takes are sorted, so a run freed together comes back as a run, and while
more than an eighth of the pool is free a request also takes blocks ahead for the
tokens it will generate (up to ``lookahead_tokens``, and no more than a group's window).
Attention then reads each sequence's K/V as long sequential streams, which on a CPU runs
about twice as fast as scattered blocks (docs/performance.md). Blocks taken ahead are
only a preference: the scheduler releases them (release_lookahead) before it preempts or
turns a request away.

Memory is touched only as far as the work needs. The pool is sized for the worst case
(gigabytes), and on a CPU the first write to each page of it faults into the kernel
(2-6 us per 4 KiB page measured here: 0.2-0.5 ms per SmolLM2 block), so cycling through
the whole pool would cost seconds and grow the process to the pool's full size. Blocks
that never held data are therefore taken only while at most ``freed_block_reserve``
freed blocks are free; above that, the least recently freed block is reused. Freed
blocks, and the prefixes they cache, are kept up to that reserve (an eighth of the pool
by default), and the memory in use grows to the workload's peak plus the reserve.

The block manager owns the mapping from sequences to blocks: callers name a sequence
by its ``seq_id`` and pass the counts and token ids a decision needs; nothing here reads
or writes a Request. ``block_table_update`` tells the model runner exactly which blocks
it may read, as a change to the tables it already holds.

A full block's hash chains its parent's hash with its own token ids, so equal
hashes mean equal whole prefixes. Hashes are 128-bit BLAKE2b digests: at 10^9
cached blocks a collision stays below 10^-20.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_LOOKAHEAD_TOKENS = 512
NO_BLOCK = -1
"""A table entry a windowed group no longer needs (freed, or never taken from a cached prefix)."""

TableUpdate = tuple[int, tuple[int, ...]]
"""A change to one block table: keep its first ``start`` entries, replace the rest with ``blocks``."""


@dataclass
class _GroupBlocks:
    """One sequence's blocks in one group, in position order (blocks taken ahead at the end)."""

    block_ids: list[int] = field(default_factory=list)
    num_dropped: int = 0  # leading entries that are NO_BLOCK (out of the window)
    num_shown: int = 0  # leading entries the runner's table holds as they are now


@dataclass
class _SeqBlocks:
    groups: list[_GroupBlocks]
    hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    namespace: bytes = b""  # the first block's parent hash: K/V of one LoRA adapter match only its own


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        lookahead_tokens: int = DEFAULT_LOOKAHEAD_TOKENS,
        freed_block_reserve: int | None = None,
        group_windows: Sequence[int] = (-1,),
    ) -> None:
        """``group_windows``: each KV-cache group's sliding window, -1 for none (one group by default)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lookahead_tokens = lookahead_tokens
        self.lookahead_floor = num_blocks // 8  # free blocks that taking blocks ahead leaves alone
        self.group_windows = tuple(group_windows)
        self.windowed = tuple(g for g, window in enumerate(self.group_windows) if window > 0)
        self.unwindowed = tuple(g for g, window in enumerate(self.group_windows) if window <= 0)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group whose prefix cache holds the block's hash
        self.hash_to_block: list[dict[bytes, int]] = [{} for _ in self.group_windows]  # per group
        # Freed blocks kept before untouched ones are used (module docstring).
        self.freed_block_reserve = num_blocks // 8 if freed_block_reserve is None else freed_block_reserve
        # Ordered set of freed blocks with ref_count 0, least recently freed first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        self.next_untouched = 0  # blocks [next_untouched, num_blocks) have never been used
        self.pending_copies: list[tuple[int, int]] = []
        self.seqs: dict[int, _SeqBlocks] = {}

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + self.num_blocks - self.next_untouched

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """Every block with ref_count 0: freed ones in reuse order, then the untouched ones."""
        return [*self.free_blocks, *range(self.next_untouched, self.num_blocks)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: int, group: int = 0) -> list[int]:
        """A copy of the blocks the sequence holds in ``group``, including any taken ahead, not
        the entries dropped out of the window (for checks and tests)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return []
        return [block for block in seq.groups[group].block_ids if block != NO_BLOCK]

    def find_cached_prefix(self, seq_id: int, token_ids: Sequence[int], lora_id: int = 0) -> list[tuple[int, ...]]:
        """The longest cached prefix of ``token_ids`` every group can use (module docstring),
        leaving at least one token to compute: per block of it, the block of each group
        (NO_BLOCK where a windowed group does not need it). ``lora_id``: the LoRA adapter the
        sequence runs with (0: none); blocks computed with another adapter never match."""
        if not self.enable_prefix_caching:
            return []
        seq = self.seqs.setdefault(seq_id, self._new_seq())
        if lora_id:
            seq.namespace = b"lora:%d" % lora_id
        self._hash_full_blocks(seq, token_ids, len(token_ids))
        found: list[tuple[int | None, ...]] = []
        for block_hash in seq.hashes[: (len(token_ids) - 1) // self.block_size]:
            row = tuple(table.get(block_hash) for table in self.hash_to_block)
            if any(row[g] is None for g in self.unwindowed):
                break
            found.append(row)
        num_hit = self._windowed_hit(found)
        firsts = [self._first_needed(g, num_hit * self.block_size) for g in range(self.num_groups)]
        return [
            tuple(block if index >= first else NO_BLOCK for block, first in zip(row, firsts))
            for index, row in enumerate(found[:num_hit])
        ]

    def allocate(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[tuple[int, ...]] = (),
        final_num_tokens: int | None = None,
    ) -> bool:
        """Give the sequence blocks in every group for ``num_new_tokens`` more tokens after its
        computed ones, first freeing those that fell out of a windowed group's window.

        ``cached_blocks`` (from find_cached_prefix, for a sequence with no blocks yet; the
        computed tokens already count them) are taken first. ``final_num_tokens`` caps the
        blocks taken ahead. Returns False if too few are free, having changed nothing but
        that freeing.
        """
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = self._new_seq()
        if self.windowed:
            self._drop_out_of_window(seq, num_computed_tokens)
        total = num_computed_tokens + num_new_tokens
        needed = self.blocks_needed(total) - len(cached_blocks)
        num_new = [max(0, needed - len(group.block_ids)) for group in seq.groups]
        copies = [self._shared_write_index(group, num_computed_tokens) for group in seq.groups]
        reserved = sum(num_new) + len(copies) - copies.count(None)  # blocks taken ahead come out of the rest
        reclaimed = sum(1 for row in cached_blocks for b in row if b != NO_BLOCK and self.ref_counts[b] == 0)
        if reserved + reclaimed > self.num_free_blocks:
            return False
        for row in cached_blocks:
            for group, block in zip(seq.groups, row):
                if block == NO_BLOCK:
                    group.num_dropped += 1
                else:
                    self._acquire(block)
                group.block_ids.append(block)
        for g, group in enumerate(seq.groups):
            if copies[g] is not None:
                self._copy_on_write(group, copies[g])
                reserved -= 1
            count = num_new[g] + self._blocks_ahead(g, group, total, num_new[g], reserved, final_num_tokens)
            if count:
                group.block_ids.extend(sorted(self._take_free_block() for _ in range(count)))
            reserved -= num_new[g]
        return True

    def block_table_update(self, seq_id: int, num_tokens: int) -> tuple[TableUpdate, ...]:
        """Per group, the blocks the runner may read for the sequence's first ``num_tokens``
        tokens, as a change to the table it was last given. Blocks taken ahead are never
        shown; NO_BLOCK entries are shown as block 0, which attention never reads there."""
        needed = self.blocks_needed(num_tokens)
        updates = []
        for group in self.seqs[seq_id].groups:
            start = min(group.num_shown, needed)
            group.num_shown = needed
            blocks = group.block_ids[start:needed]
            if start < group.num_dropped:
                blocks = [max(block, 0) for block in blocks]
            updates.append((start, tuple(blocks)))
        return tuple(updates)

    def release_lookahead(self, token_counts: Iterable[tuple[int, int]]) -> int:
        """Free the blocks sequences took ahead of their tokens; ``token_counts`` gives
        (seq_id, num_tokens) for each. Returns how many blocks were freed."""
        released = 0
        for seq_id, num_tokens in token_counts:
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            keep = self.blocks_needed(num_tokens)
            for group in seq.groups:
                for block in group.block_ids[keep:]:  # taken ahead: never shared, never hashed
                    self.ref_counts[block] -= 1
                    self.free_blocks[block] = None
                    self.free_blocks.move_to_end(block, last=False)  # reused before blocks holding a cached prefix
                    released += 1
                del group.block_ids[keep:]
        return released

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks and forget it; tail blocks first (in every group), so
        they are evicted before shared prefixes."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for index in reversed(range(max(len(group.block_ids) for group in seq.groups))):
            for group in seq.groups:
                if index < len(group.block_ids):
                    self._release(group.block_ids[index])

    def fork(self, parent_id: int, child_id: int, num_computed_tokens: int) -> None:
        """Share the parent's blocks holding its computed tokens with the child (copy-on-write on
        the child's next write)."""
        parent = self.seqs[parent_id]
        num_shared = self.blocks_needed(num_computed_tokens)
        groups = []
        for group in parent.groups:
            shared = group.block_ids[:num_shared]
            for block in shared:
                if block != NO_BLOCK:
                    self.ref_counts[block] += 1
            groups.append(_GroupBlocks(shared, min(group.num_dropped, len(shared))))
        hashes = parent.hashes[: num_computed_tokens // self.block_size]
        registered = min(parent.num_registered, len(hashes))
        self.seqs[child_id] = _SeqBlocks(groups, list(hashes), registered, parent.namespace)

    def cache_computed_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register hashes of the sequence's full, computed blocks so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        seq = self.seqs[seq_id]
        num_full = num_computed_tokens // self.block_size
        self._hash_full_blocks(seq, token_ids, num_full * self.block_size)
        for index in range(seq.num_registered, num_full):
            block_hash = seq.hashes[index]
            for g, group in enumerate(seq.groups):
                block, cache = group.block_ids[index], self.hash_to_block[g]
                if block != NO_BLOCK and self.block_hash[block] is None and block_hash not in cache:
                    self.block_hash[block] = block_hash
                    self.block_group[block] = g
                    cache[block_hash] = block
        seq.num_registered = max(seq.num_registered, num_full)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies recorded since the last call, to be run one
        after another in this order before the step's forward pass. Order matters: when a
        preemption frees the source of a copy in the step that recorded it, the block can be
        taken again as another copy's destination in the same step, after it was read.
        Copies into blocks nobody holds any more (their sequence was preempted) are left out."""
        copies, self.pending_copies = self.pending_copies, []
        return [(source, destination) for source, destination in copies if self.ref_counts[destination] > 0]

    def _new_seq(self) -> _SeqBlocks:
        return _SeqBlocks([_GroupBlocks() for _ in self.group_windows])

    def _first_needed(self, group: int, num_computed_tokens: int) -> int:
        """The first block the group's next query (at position num_computed_tokens) reads."""
        window = self.group_windows[group]
        return 0 if window <= 0 else max(0, num_computed_tokens - window + 1) // self.block_size

    def _windowed_hit(self, found: list[tuple[int | None, ...]]) -> int:
        """The most leading blocks of ``found`` (cached in every group without a window) whose
        windowed groups also hold every block the next query reads."""
        num_hit = len(found)
        while num_hit and self.windowed:
            size = num_hit * self.block_size
            missing = max(
                (i for g in self.windowed for i in range(num_hit - 1, self._first_needed(g, size) - 1, -1)
                 if found[i][g] is None),
                default=None,
            )  # fmt: skip
            if missing is None:
                break
            num_hit = missing  # a hit past a missing block would read it
        return num_hit

    def _drop_out_of_window(self, seq: _SeqBlocks, num_computed_tokens: int) -> None:
        for g in self.windowed:
            group = seq.groups[g]
            first = min(self._first_needed(g, num_computed_tokens), len(group.block_ids))
            for index in range(group.num_dropped, first):
                self._release(group.block_ids[index])
                group.block_ids[index] = NO_BLOCK
            group.num_dropped = max(group.num_dropped, first)

    def _blocks_ahead(self, g: int, group: _GroupBlocks, total: int, num_new_blocks: int, reserved: int,
                      final_num_tokens: int | None) -> int:
        """Blocks to take beyond ``total`` tokens in group ``g``: up to the sequence's final
        length, capped at lookahead_tokens (and a windowed group's window), leaving the
        ``reserved`` blocks the allocation still takes and lookahead_floor more free."""
        window = self.group_windows[g]
        ahead = total + (self.lookahead_tokens if window <= 0 else min(self.lookahead_tokens, window))
        final = ahead if final_num_tokens is None else min(final_num_tokens, ahead)
        wanted = self.blocks_needed(final) - len(group.block_ids) - num_new_blocks
        spare = self.num_free_blocks - reserved - self.lookahead_floor
        return max(0, min(wanted, spare))

    def _hash_full_blocks(self, seq: _SeqBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        hashes = seq.hashes
        size = self.block_size
        for index in range(len(hashes), num_tokens // size):
            parent = hashes[index - 1] if index else seq.namespace
            tokens = np.asarray(token_ids[index * size : (index + 1) * size], dtype=np.int64)
            hashes.append(hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest())

    def _shared_write_index(self, group: _GroupBlocks, num_computed_tokens: int) -> int | None:
        """Index of the partly filled block the next token goes into, if other sequences share it."""
        offset = num_computed_tokens % self.block_size
        index = num_computed_tokens // self.block_size
        if offset == 0 or index >= len(group.block_ids):
            return None
        return index if self.ref_counts[group.block_ids[index]] > 1 else None

    def _copy_on_write(self, group: _GroupBlocks, index: int) -> None:
        source = group.block_ids[index]
        copy = self._take_free_block()
        self.ref_counts[source] -= 1
        group.block_ids[index] = copy
        group.num_shown = min(group.num_shown, index)
        self.pending_copies.append((source, copy))

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        if block == NO_BLOCK:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def _take_free_block(self) -> int:
        if self.next_untouched < self.num_blocks and len(self.free_blocks) <= self.freed_block_reserve:
            block = self.next_untouched
            self.next_untouched += 1
        else:
            block, _ = self.free_blocks.popitem(last=False)
            evicted = self.block_hash[block]
            if evicted is not None:
                del self.hash_to_block[self.block_group[block]][evicted]
                self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
