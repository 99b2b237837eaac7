"""BlockManager: the paged KV cache's bookkeeping (no tensors live here).

Blocks hold ``block_size`` tokens. Each has a reference count; a block whose count
drops to zero goes to the back of the queue of freed blocks but keeps its prefix hash,
so a later request with the same prefix can take it back (automatic prefix caching).
Allocations reuse freed blocks from the front of that queue: the least recently freed
block is evicted first (LRU).

Blocks of one request are kept contiguous where the pool allows: the blocks an
allocation takes are sorted, so a run freed together comes back as a run, and while
more than an eighth of the pool is free a request also takes blocks ahead for the
tokens it will generate (up to ``lookahead_tokens``). Attention then reads each
sequence's K/V as long sequential streams, which on a CPU runs about twice as fast as
scattered blocks (docs/performance.md). Blocks taken ahead are only a preference: the
scheduler releases them (release_lookahead) before it preempts or turns a request away.

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
it may read, as a change to the table it already holds.

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


@dataclass
class _SeqBlocks:
    """One sequence's blocks, in position order (blocks taken ahead at the end)."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_shown: int = 0  # leading blocks the runner's table holds as they are now


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        lookahead_tokens: int = DEFAULT_LOOKAHEAD_TOKENS,
        freed_block_reserve: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lookahead_tokens = lookahead_tokens
        self.lookahead_floor = num_blocks // 8  # free blocks that taking blocks ahead leaves alone
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Freed blocks kept before untouched ones are used (module docstring).
        self.freed_block_reserve = num_blocks // 8 if freed_block_reserve is None else freed_block_reserve
        # Ordered set of freed blocks with ref_count 0, least recently freed first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        self.next_untouched = 0  # blocks [next_untouched, num_blocks) have never been used
        self.pending_copies: list[tuple[int, int]] = []
        self.seqs: dict[int, _SeqBlocks] = {}

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

    def block_ids(self, seq_id: int) -> list[int]:
        """A copy of the sequence's blocks, including any taken ahead (for checks and tests)."""
        seq = self.seqs.get(seq_id)
        return list(seq.block_ids) if seq is not None else []

    def find_cached_prefix(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding a prefix of ``token_ids``, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        seq = self.seqs.setdefault(seq_id, _SeqBlocks())
        self._hash_full_blocks(seq, token_ids, len(token_ids))
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.hashes[:max_blocks]:
            block = self.hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        final_num_tokens: int | None = None,
    ) -> list[int] | None:
        """Give the sequence blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (from find_cached_prefix, for a sequence with no blocks yet; the
        computed tokens already count them) are taken first. ``final_num_tokens`` caps the
        blocks taken ahead. Returns the blocks taken, or None, changing nothing, if too few
        are free.
        """
        seq = self.seqs.setdefault(seq_id, _SeqBlocks())
        total = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(seq.block_ids) - len(cached_blocks))
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        shared_index = self._shared_write_index(seq, num_computed_tokens)
        if num_new_blocks + reclaimed + (shared_index is not None) > self.num_free_blocks:
            return None
        for block in cached_blocks:
            self._acquire(block)
        seq.block_ids.extend(cached_blocks)
        if shared_index is not None:
            self._copy_on_write(seq, shared_index)
        num_new_blocks += self._blocks_ahead(seq, total, num_new_blocks, final_num_tokens)
        new_blocks = sorted(self._take_free_block() for _ in range(num_new_blocks))
        seq.block_ids.extend(new_blocks)
        return [*cached_blocks, *new_blocks]

    def block_table_update(self, seq_id: int, num_tokens: int) -> tuple[int, list[int]]:
        """The blocks the runner may read for the sequence's first ``num_tokens`` tokens, as a
        change to the table it was last given: keep its first ``start`` entries, replace the
        rest with ``blocks``. Blocks taken ahead are never shown."""
        seq = self.seqs[seq_id]
        needed = self.blocks_needed(num_tokens)
        start = min(seq.num_shown, needed)
        seq.num_shown = needed
        return start, seq.block_ids[start:needed]

    def release_lookahead(self, token_counts: Iterable[tuple[int, int]]) -> int:
        """Free the blocks sequences took ahead of their tokens; ``token_counts`` gives
        (seq_id, num_tokens) for each. Returns how many blocks were freed."""
        released = 0
        for seq_id, num_tokens in token_counts:
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            keep = self.blocks_needed(num_tokens)
            for block in seq.block_ids[keep:]:  # taken ahead: never shared, never hashed
                self.ref_counts[block] -= 1
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)  # reused before blocks holding a cached prefix
                released += 1
            del seq.block_ids[keep:]
        return released

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks and forget it; tail blocks first, so they are evicted
        before shared prefixes."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def fork(self, parent_id: int, child_id: int, num_computed_tokens: int) -> None:
        """Share the parent's blocks holding its computed tokens with the child (copy-on-write on
        the child's next write)."""
        parent = self.seqs[parent_id]
        shared = parent.block_ids[: self.blocks_needed(num_computed_tokens)]
        for block in shared:
            self.ref_counts[block] += 1
        hashes = parent.hashes[: num_computed_tokens // self.block_size]
        self.seqs[child_id] = _SeqBlocks(list(shared), list(hashes), min(parent.num_registered, len(hashes)))

    def cache_computed_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register hashes of the sequence's full, computed blocks so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        seq = self.seqs[seq_id]
        num_full = num_computed_tokens // self.block_size
        self._hash_full_blocks(seq, token_ids, num_full * self.block_size)
        for index in range(seq.num_registered, num_full):
            block, block_hash = seq.block_ids[index], seq.hashes[index]
            if self.block_hash[block] is None and block_hash not in self.hash_to_block:
                self.block_hash[block] = block_hash
                self.hash_to_block[block_hash] = block
        seq.num_registered = max(seq.num_registered, num_full)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _blocks_ahead(self, seq: _SeqBlocks, total: int, num_new_blocks: int, final_num_tokens: int | None) -> int:
        """Blocks to take beyond ``total`` tokens: up to the sequence's final length, capped at
        lookahead_tokens, without taking the pool below lookahead_floor."""
        ahead = total + self.lookahead_tokens
        final = ahead if final_num_tokens is None else min(final_num_tokens, ahead)
        wanted = self.blocks_needed(final) - len(seq.block_ids) - num_new_blocks
        spare = self.num_free_blocks - num_new_blocks - self.lookahead_floor
        return max(0, min(wanted, spare))

    def _hash_full_blocks(self, seq: _SeqBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        hashes = seq.hashes
        size = self.block_size
        for index in range(len(hashes), num_tokens // size):
            parent = hashes[index - 1] if index else b""
            tokens = np.asarray(token_ids[index * size : (index + 1) * size], dtype=np.int64)
            hashes.append(hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest())

    def _shared_write_index(self, seq: _SeqBlocks, num_computed_tokens: int) -> int | None:
        """Index of the partly filled block the next token goes into, if other sequences share it."""
        offset = num_computed_tokens % self.block_size
        index = num_computed_tokens // self.block_size
        if offset == 0 or index >= len(seq.block_ids):
            return None
        return index if self.ref_counts[seq.block_ids[index]] > 1 else None

    def _copy_on_write(self, seq: _SeqBlocks, index: int) -> None:
        source = seq.block_ids[index]
        copy = self._take_free_block()
        self.ref_counts[source] -= 1
        seq.block_ids[index] = copy
        seq.num_shown = min(seq.num_shown, index)
        self.pending_copies.append((source, copy))

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _take_free_block(self) -> int:
        if self.next_untouched < self.num_blocks and len(self.free_blocks) <= self.freed_block_reserve:
            block = self.next_untouched
            self.next_untouched += 1
        else:
            block, _ = self.free_blocks.popitem(last=False)
            evicted = self.block_hash[block]
            if evicted is not None:
                del self.hash_to_block[evicted]
                self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
