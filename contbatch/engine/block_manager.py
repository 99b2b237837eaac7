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

A full block's hash chains its parent's hash with its own token ids, so equal
hashes mean equal whole prefixes. Hashes are 128-bit BLAKE2b digests: at 10^9
cached blocks a collision stays below 10^-20.
"""

import hashlib
from collections import OrderedDict

import numpy as np

from contbatch.engine.request import Request

DEFAULT_LOOKAHEAD_TOKENS = 512


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
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + self.num_blocks - self.next_untouched

    def free_block_ids(self) -> list[int]:
        """Every block with ref_count 0: freed ones in reuse order, then the untouched ones."""
        return [*self.free_blocks, *range(self.next_untouched, self.num_blocks)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request, leaving at least one token to compute."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        self._hash_full_blocks(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (from find_cached_prefix, for a request with no blocks yet, whose
        num_computed_tokens already counts them) are taken first. Returns False, changing
        nothing, if too few blocks are free.
        """
        total = request.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(request.block_ids) - len(cached_blocks))
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        needs_copy = self._shared_write_block(request) is not None
        if num_new_blocks + reclaimed + needs_copy > self.num_free_blocks:
            return False
        if not request.block_ids and self.enable_prefix_caching:
            self.num_cache_queries += request.num_tokens
            self.num_cache_hits += len(cached_blocks) * self.block_size
        for block in cached_blocks:
            self._acquire(block)
        request.block_ids.extend(cached_blocks)
        if needs_copy:
            self._copy_on_write(request)
        num_new_blocks += self._blocks_ahead(request, total, num_new_blocks)
        request.block_ids.extend(sorted(self._take_free_block() for _ in range(num_new_blocks)))
        return True

    def release_lookahead(self, requests: list[Request]) -> int:
        """Free the blocks the requests took ahead of their tokens; returns how many."""
        released = 0
        for request in requests:
            keep = self.blocks_needed(request.num_tokens)
            for block in request.block_ids[keep:]:  # taken ahead: never shared, never hashed
                self.ref_counts[block] -= 1
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)  # reused before blocks holding a cached prefix
                released += 1
            del request.block_ids[keep:]
        return released

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks first, so they are evicted before shared prefixes."""
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Share the parent's blocks holding computed tokens with the child (copy-on-write on its next write)."""
        shared = parent.block_ids[: self.blocks_needed(parent.num_computed_tokens)]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_ids = list(shared)
        child.block_hashes = list(parent.block_hashes[: parent.num_computed_tokens // self.block_size])
        child.num_registered_blocks = min(parent.num_registered_blocks, len(child.block_hashes))

    def cache_computed_blocks(self, request: Request) -> None:
        """Register hashes of the request's full, computed blocks so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        self._hash_full_blocks(request, num_full * self.block_size)
        for index in range(request.num_registered_blocks, num_full):
            block, block_hash = request.block_ids[index], request.block_hashes[index]
            if self.block_hash[block] is None and block_hash not in self.hash_to_block:
                self.block_hash[block] = block_hash
                self.hash_to_block[block_hash] = block
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _blocks_ahead(self, request: Request, total: int, num_new_blocks: int) -> int:
        """Blocks to take beyond ``total`` tokens: up to the request's final length, capped at
        lookahead_tokens, without taking the pool below lookahead_floor."""
        ahead = total + self.lookahead_tokens
        max_tokens = request.params.max_tokens
        final = ahead if max_tokens is None else min(request.num_prompt_tokens + max_tokens, ahead)
        wanted = self.blocks_needed(final) - len(request.block_ids) - num_new_blocks
        spare = self.num_free_blocks - num_new_blocks - self.lookahead_floor
        return max(0, min(wanted, spare))

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        size = self.block_size
        for index in range(len(hashes), num_tokens // size):
            parent = hashes[index - 1] if index else b""
            tokens = np.asarray(request.token_ids[index * size : (index + 1) * size], dtype=np.int64)
            hashes.append(hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest())

    def _shared_write_block(self, request: Request) -> int | None:
        """The partly filled block the next token goes into, if other requests share it."""
        offset = request.num_computed_tokens % self.block_size
        index = request.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(request.block_ids):
            return None
        block = request.block_ids[index]
        return block if self.ref_counts[block] > 1 else None

    def _copy_on_write(self, request: Request) -> None:
        index = request.num_computed_tokens // self.block_size
        source = request.block_ids[index]
        copy = self._take_free_block()
        self.ref_counts[source] -= 1
        request.block_ids[index] = copy
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
