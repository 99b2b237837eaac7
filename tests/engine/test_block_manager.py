"""Block manager: prefix-cache eviction order, copy-on-write on forked requests, and refusal without side effects."""

import hypothesis.strategies as st
from hypothesis import given, settings

from contbatch.engine.block_manager import BlockManager
from contbatch.engine.request import Request
from contbatch.sampling_params import SamplingParams


def _request(request_id: int, tokens: list[int]) -> Request:
    return Request(request_id, None, tokens, SamplingParams(temperature=0), frozenset())


def _compute(manager: BlockManager, request: Request, num_tokens: int) -> None:
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_computed_blocks(request)


def test_freed_prefix_blocks_are_reused_until_evicted_lru():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = _request(0, [10, 11, 12, 13, 14])
    _compute(manager, first, 5)
    manager.free(first)
    assert manager.num_free_blocks == 4

    again = _request(1, [10, 11, 12, 13, 99])
    assert len(manager.find_cached_prefix(again)) == 2

    # Filling the cache with other content evicts the old prefix, least recently freed first.
    other = _request(2, [50, 51, 52, 53, 54, 55, 56, 57])
    _compute(manager, other, 8)
    assert manager.find_cached_prefix(_request(3, [10, 11, 12, 13, 99])) == []


def test_fork_then_write_copies_the_shared_partial_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = _request(0, [5, 6, 7, 8, 9, 10])  # one full block and a partial one
    _compute(manager, parent, 6)
    child = _request(1, list(parent.token_ids))
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    assert [manager.ref_counts[b] for b in parent.block_ids] == [2, 2]

    assert manager.allocate_slots(child, 1)
    (source, copy), = manager.take_pending_copies()
    assert source == parent.block_ids[1] and copy == child.block_ids[1] and copy != source
    assert child.block_ids[0] == parent.block_ids[0], "the full block stays shared"
    assert manager.ref_counts[source] == 1 and manager.ref_counts[copy] == 1


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 3, 16]),
    held=st.integers(0, 200),
    asked=st.integers(1, 200),
)
def test_failed_allocation_changes_nothing(num_blocks, block_size, held, asked):
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    holder = _request(0, list(range(3, 3 + max(held, 1))))
    manager.allocate_slots(holder, min(held, num_blocks * block_size))
    before = (list(manager.ref_counts), list(manager.free_blocks))
    request = _request(1, list(range(3, 3 + asked)))
    ok = manager.allocate_slots(request, asked)
    if ok:
        assert len(request.block_ids) == manager.blocks_needed(asked)
    else:
        assert (list(manager.ref_counts), list(manager.free_blocks)) == before and request.block_ids == []
        assert manager.blocks_needed(asked) > manager.num_free_blocks
