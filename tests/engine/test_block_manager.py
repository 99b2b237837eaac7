"""Block manager: prefix-cache eviction order, copy-on-write on forked requests, refusal without
side effects, and blocks taken ahead (contiguous, capped, above the floor, released on demand)."""

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import given, settings

from contbatch.engine.block_manager import BlockManager


@dataclass
class _Seq:
    """What the scheduler knows of a sequence and passes to the block manager."""

    seq_id: int
    token_ids: list[int]
    max_tokens: int
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


def _request(seq_id: int, tokens: list[int], max_tokens: int = 16) -> _Seq:
    return _Seq(seq_id, list(tokens), max_tokens)


def _allocate(manager: BlockManager, seq: _Seq, num_tokens: int, cached: list[tuple[int, ...]] = ()) -> bool:
    final = seq.num_prompt_tokens + seq.max_tokens
    return manager.allocate(seq.seq_id, seq.num_computed_tokens, num_tokens, cached, final)


def _compute(manager: BlockManager, seq: _Seq, num_tokens: int) -> None:
    assert _allocate(manager, seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)


def _counts(seqs: list[_Seq]) -> list[tuple[int, int]]:
    return [(s.seq_id, s.num_tokens) for s in seqs]


def test_freed_prefix_blocks_are_reused_until_evicted_lru():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = _request(0, [10, 11, 12, 13, 14])
    _compute(manager, first, 5)
    manager.free(first.seq_id)
    assert manager.num_free_blocks == 4

    again = _request(1, [10, 11, 12, 13, 99])
    assert len(manager.find_cached_prefix(again.seq_id, again.token_ids)) == 2

    # Filling the cache with other content evicts the old prefix, least recently freed first.
    other = _request(2, [50, 51, 52, 53, 54, 55, 56, 57])
    _compute(manager, other, 8)
    assert manager.find_cached_prefix(3, [10, 11, 12, 13, 99]) == []


def test_fork_then_write_copies_the_shared_partial_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, lookahead_tokens=0)
    parent = _request(0, [5, 6, 7, 8, 9, 10])  # one full block and a partial one
    _compute(manager, parent, 6)
    child = _request(1, list(parent.token_ids))
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
    parent_blocks = manager.block_ids(parent.seq_id)
    assert [manager.ref_counts[b] for b in parent_blocks] == [2, 2]
    assert manager.block_table_update(child.seq_id, 6) == ((0, tuple(parent_blocks)),)

    assert _allocate(manager, child, 1)
    (source, copy), = manager.take_pending_copies()
    child_blocks = manager.block_ids(child.seq_id)
    assert source == parent_blocks[1] and copy == child_blocks[1] and copy != source
    assert child_blocks[0] == parent_blocks[0], "the full block stays shared"
    assert manager.block_table_update(child.seq_id, 7) == ((1, (copy,)),), "the runner's table swaps in the copy"
    assert manager.ref_counts[source] == 1 and manager.ref_counts[copy] == 1


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 3, 16]),
    held=st.integers(0, 200),
    asked=st.integers(1, 200),
)
def test_failed_allocation_changes_nothing(num_blocks, block_size, held, asked):
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True, lookahead_tokens=0)
    holder = _request(0, list(range(3, 3 + max(held, 1))))
    _allocate(manager, holder, min(held, num_blocks * block_size))
    before = (list(manager.ref_counts), manager.free_block_ids())
    request = _request(1, list(range(3, 3 + asked)))
    ok = _allocate(manager, request, asked)
    if ok:
        assert len(manager.block_ids(1)) == manager.blocks_needed(asked)
    else:
        assert (list(manager.ref_counts), manager.free_block_ids()) == before and manager.block_ids(1) == []
        assert manager.blocks_needed(asked) > manager.num_free_blocks


def _decode_in_turns(manager: BlockManager, requests: list[_Seq], steps: int) -> None:
    """Prefill every request, then grow them one token each per step, as a running batch does."""
    for request in requests:
        _compute(manager, request, request.num_tokens)
    for _ in range(steps):
        for request in requests:
            request.token_ids.append(7)
            _compute(manager, request, 1)


def test_blocks_taken_ahead_keep_each_sequence_contiguous():
    def block_gaps(lookahead_tokens: int) -> int:
        manager = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False, lookahead_tokens=lookahead_tokens)
        requests = [_request(i, [3 + i] * 5, max_tokens=30) for i in range(4)]
        _decode_in_turns(manager, requests, steps=30)
        tables = [manager.block_ids(r.seq_id) for r in requests]
        for request, table in zip(requests, tables):
            assert len(table) == manager.blocks_needed(request.num_tokens)
        return sum(b - a != 1 for table in tables for a, b in zip(table, table[1:]))

    assert block_gaps(lookahead_tokens=0) > 0, "interleaved growth scatters blocks without lookahead"
    assert block_gaps(lookahead_tokens=64) == 0


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4]),
    lookahead_tokens=st.integers(0, 40),
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    max_tokens=st.integers(1, 40),
    steps=st.integers(0, 30),
)
def test_lookahead_is_capped_and_leaves_the_floor_free(num_blocks, block_size, lookahead_tokens, prompts, max_tokens, steps):
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False, lookahead_tokens=lookahead_tokens)
    requests = [_request(i, [3] * length, max_tokens) for i, length in enumerate(prompts)]
    for _ in range(steps + 1):
        for request in requests:
            if request.num_computed_tokens == request.num_tokens:
                if request.num_output_tokens >= max_tokens:
                    continue
                request.token_ids.append(7)
            free_before = manager.num_free_blocks
            blocks_before = len(manager.block_ids(request.seq_id))
            new_tokens = request.num_tokens - request.num_computed_tokens
            if not _allocate(manager, request, new_tokens):
                continue
            request.num_computed_tokens = request.num_tokens
            needed = manager.blocks_needed(request.num_tokens)
            final = request.num_prompt_tokens + max_tokens
            num_blocks_now = len(manager.block_ids(request.seq_id))
            assert needed <= num_blocks_now <= max(
                needed, manager.blocks_needed(min(final, request.num_tokens + lookahead_tokens))
            ), "more blocks than the request's final length or the lookahead"
            taken_ahead = num_blocks_now - max(needed, blocks_before)
            if taken_ahead > 0:
                assert manager.num_free_blocks >= manager.lookahead_floor
            assert free_before - manager.num_free_blocks == num_blocks_now - blocks_before
            ((start, shown),) = manager.block_table_update(request.seq_id, request.num_tokens)
            assert start + len(shown) == needed, "the runner sees exactly the blocks of its tokens"

    released = manager.release_lookahead(_counts(requests))
    tables = [manager.block_ids(r.seq_id) for r in requests]
    for request, table in zip(requests, tables):  # a request whose last allocation failed has fewer blocks than tokens
        needed_now = manager.blocks_needed(request.num_computed_tokens)
        assert needed_now <= len(table) <= manager.blocks_needed(request.num_tokens)
    in_use = sum(len(t) for t in tables)
    assert manager.num_free_blocks == num_blocks - in_use
    assert released >= 0 and sorted(manager.free_block_ids()) == sorted(
        set(range(num_blocks)) - {b for t in tables for b in t}
    )


def test_released_blocks_are_reused_before_cached_prefixes():
    # A reserve of the whole pool: untouched blocks go first, then the freed queue's front.
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True, lookahead_tokens=8,
                           freed_block_reserve=8)
    cached = _request(0, [10, 11, 12, 13, 14], max_tokens=1)
    _compute(manager, cached, 5)
    manager.free(cached.seq_id)  # its two full blocks stay in the prefix cache
    grower = _request(1, [20, 21, 22], max_tokens=20)
    _compute(manager, grower, 3)
    assert len(manager.block_ids(grower.seq_id)) > manager.blocks_needed(3), "took blocks ahead"
    assert manager.release_lookahead(_counts([grower])) > 0
    other = _request(2, [30, 31, 32, 33, 34, 35], max_tokens=1)
    _compute(manager, other, 6)
    assert len(manager.find_cached_prefix(3, [10, 11, 12, 13, 99])) == 2


def _run_one_at_a_time(manager: BlockManager, prompts: list[list[int]]) -> None:
    """Prefill each prompt alone, taking its cached prefix as the scheduler does, then free it."""
    for i, tokens in enumerate(prompts):
        request = _request(i, tokens, max_tokens=1)
        cached = manager.find_cached_prefix(request.seq_id, request.token_ids)
        request.num_computed_tokens = len(cached) * manager.block_size
        assert _allocate(manager, request, len(tokens) - request.num_computed_tokens, cached)
        request.num_computed_tokens = len(tokens)
        manager.cache_computed_blocks(request.seq_id, request.token_ids, request.num_computed_tokens)
        manager.free(request.seq_id)


def test_memory_is_touched_only_up_to_the_peak_use_plus_the_reserve():
    manager = BlockManager(num_blocks=1000, block_size=4, enable_prefix_caching=True, lookahead_tokens=0,
                           freed_block_reserve=10)
    # 200 requests of 3 blocks each, no shared prefix, one at a time: 600 allocations.
    _run_one_at_a_time(manager, [[i, i, i, i] * 3 for i in range(200)])
    assert manager.next_untouched <= 3 + 10 + 1, "blocks beyond the peak use and the reserve were touched"
    assert manager.num_free_blocks == 1000
    # With the reserve as large as the pool, every block is used once before any is reused.
    everything = BlockManager(num_blocks=1000, block_size=4, enable_prefix_caching=True, lookahead_tokens=0,
                              freed_block_reserve=1000)
    _run_one_at_a_time(everything, [[i, i, i, i] * 3 for i in range(200)])
    assert everything.next_untouched == 600


@settings(max_examples=100, deadline=None)
@given(reserve=st.integers(0, 12), num_prefixes=st.integers(1, 12), repeats=st.integers(1, 4))
def test_freed_prefixes_within_the_reserve_stay_cached(reserve, num_prefixes, repeats):
    manager = BlockManager(num_blocks=64, block_size=2, enable_prefix_caching=True, lookahead_tokens=0,
                           freed_block_reserve=reserve)
    # Each prompt is one distinct full block plus one token (a partial block, never cached).
    prompts = [[100 + i, 200 + i, 7] for i in range(num_prefixes)]
    for _ in range(repeats):
        _run_one_at_a_time(manager, prompts)
    # At least `reserve` blocks stay in the freed queue, the most recently freed: the last
    # reserve // 2 requests' two blocks each, whose full blocks keep their prefix.
    kept = min(num_prefixes, reserve // 2)
    for i in range(num_prefixes - kept, num_prefixes):
        assert manager.find_cached_prefix(99, [100 + i, 200 + i, 8]) != [], f"prefix {i} was evicted"
    assert manager.next_untouched <= 2 + reserve + 1


def test_a_copy_source_freed_by_preemption_is_read_before_it_is_written_again():
    """One step: a sample copies its shared partial block, the other holders of that block
    are preempted (freed), and the freed block is taken as the destination of the next copy.
    The copies come out in that order, and a copy whose sequence was freed is left out."""
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, lookahead_tokens=0,
                           freed_block_reserve=0)
    first = _request(0, [5, 6, 7, 8, 9, 10])  # one full block and a partial one
    _compute(manager, first, 6)
    second = _request(1, [20, 21])  # one partial block
    _compute(manager, second, 2)
    samples = []
    for parent, seq_id in ((first, 2), (first, 3), (second, 4)):
        manager.fork(parent.seq_id, seq_id, parent.num_computed_tokens)
        sample = _request(seq_id, list(parent.token_ids))
        sample.num_computed_tokens = parent.num_computed_tokens
        samples.append(sample)
    shared = manager.block_ids(first.seq_id)[1]
    assert _allocate(manager, samples[0], 1)  # copies `shared`, still held by seqs 0 and 3
    manager.free(first.seq_id)
    manager.free(samples[1].seq_id)  # preempted: `shared` is free again
    assert manager.ref_counts[shared] == 0
    assert _allocate(manager, samples[2], 1)  # copies seq 1's block into the first free block
    assert manager.block_ids(samples[2].seq_id)[0] == shared
    doomed = _request(5, [30, 31, 32])
    manager.fork(second.seq_id, doomed.seq_id, 2)
    doomed.num_computed_tokens = 2
    assert _allocate(manager, doomed, 1)
    doomed_copy = manager.block_ids(doomed.seq_id)[0]
    manager.free(doomed.seq_id)  # preempted after its copy was recorded
    copies = manager.take_pending_copies()
    assert copies == [(shared, manager.block_ids(samples[0].seq_id)[1]), (manager.block_ids(second.seq_id)[0], shared)]
    assert all(destination != doomed_copy for _, destination in copies)
