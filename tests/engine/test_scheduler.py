"""Scheduler + block manager under random workloads, driven by a fake model runner.

The fake runner plays the KV cache: it writes (token, position) into every slot the
step assigns and checks that each scheduled sequence's block table maps all of its
context positions to its own tokens. So any bookkeeping error (a leaked, shared,
evicted or mis-hashed block) shows up as a sequence attending to wrong K/V.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from contbatch.engine.block_manager import BlockManager
from contbatch.engine.request import Request
from contbatch.engine.scheduler import Scheduler, SchedulerOutput
from contbatch.sampling_params import SamplingParams

EOS = 2
VOCAB = 50


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, int]] = {}

    def execute(self, step: SchedulerOutput) -> dict[Request, int]:
        for source, destination in step.blocks_to_copy:
            for offset in range(self.block_size):
                copied = self.slots.get(source * self.block_size + offset)
                if copied is not None:
                    self.slots[destination * self.block_size + offset] = copied
        sampled = {}
        for item in step.scheduled:
            request = item.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
            assert len(request.block_ids) * self.block_size >= end, "too few blocks for the step's tokens"
            for position in range(start, end):
                self.slots[self._slot(request, position)] = (request.token_ids[position], position)
            for position in range(end):
                assert self.slots.get(self._slot(request, position)) == (request.token_ids[position], position), (
                    f"request {request.request_id} would attend to wrong K/V at position {position}"
                )
            if item.samples:
                sampled[request] = _next_token(request)
        return sampled

    def _slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size


def _next_token(request: Request) -> int:
    """Deterministic per request, sample and length, with EOS now and then."""
    return (request.request_id * 31 + request.sample_index * 7 + request.num_tokens * 17) % VOCAB


def _prompts(draw, count: int) -> list[list[int]]:
    """Prompts that often share prefixes, so the prefix cache gets hits."""
    stems = draw(st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=40), min_size=1, max_size=3))
    prompts = []
    for _ in range(count):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1 if not stem else 0, max_size=30))
        prompts.append(stem + tail or [5])
    return prompts


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(80, 160))
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(blocks_per_seq, blocks_per_seq * 4))
    count = draw(st.integers(1, 24))
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(3, 8)),
        budget=draw(st.integers(1, 64)),
        prefix_caching=draw(st.booleans()),
        lookahead_tokens=draw(st.sampled_from([0, 1, 8, 512])),
        prompts=_prompts(draw, count),
        max_tokens=[draw(st.integers(1, 40)) for _ in range(count)],
        n=[draw(st.integers(1, 3)) for _ in range(count)],
        ignore_eos=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_exactly_once_with_consistent_cache(w):
    manager = BlockManager(w["num_blocks"], w["block_size"], w["prefix_caching"], w["lookahead_tokens"])
    scheduler = Scheduler(manager, w["max_num_seqs"], w["budget"], w["max_model_len"])
    runner = FakeRunner(w["block_size"])
    requests = []
    for index, (prompt, max_tokens, n) in enumerate(zip(w["prompts"], w["max_tokens"], w["n"])):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=w["ignore_eos"], n=n)
        request = Request(index, None, prompt, params, frozenset({EOS}))
        requests.append(request)
        scheduler.add_request(request)

    finished: list[Request] = []
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        step = scheduler.schedule()
        assert not step.is_empty, "no progress with requests waiting"
        assert step.num_batched_tokens <= w["budget"]
        assert len(step.scheduled) <= w["max_num_seqs"]
        assert len({id(s.request) for s in step.scheduled}) == len(step.scheduled)
        scheduler.update(step, runner.execute(step))
        finished.extend(scheduler.free_finished())
        _check_block_invariants(manager, scheduler.running)
    assert not scheduler.has_unfinished()

    expected = sorted((i, s) for i, n in enumerate(w["n"]) for s in range(n))
    assert sorted((r.request_id, r.sample_index) for r in finished) == expected, "every sample finishes exactly once"
    for request in finished:
        assert request.prompt_token_ids == w["prompts"][request.request_id]
        _check_stopping(request, w["max_model_len"])
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    assert all(count == 0 for count in manager.ref_counts)


def _check_stopping(request: Request, max_model_len: int) -> None:
    outputs = request.output_token_ids
    assert len(outputs) >= 1
    expected_length = min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)
    if request.finish_reason == "stop":
        assert outputs[-1] == EOS and EOS not in outputs[:-1] and not request.params.ignore_eos
    else:
        assert request.finish_reason == "length"
        assert len(outputs) == expected_length
        assert request.params.ignore_eos or EOS not in outputs


def _check_block_invariants(manager: BlockManager, running: list[Request]) -> None:
    holders = [0] * manager.num_blocks
    for request in running:
        for block in request.block_ids:
            holders[block] += 1
    assert holders == manager.ref_counts, "reference counts differ from the blocks requests hold"
    assert set(manager.free_block_ids()) == {b for b, count in enumerate(manager.ref_counts) if count == 0}
    for block_hash, block in manager.hash_to_block.items():
        assert manager.block_hash[block] == block_hash


def test_prefix_cache_hit_is_capped_below_prompt_length():
    """A fully cached prompt still computes its last token (it needs logits)."""
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(4)
    prompt = list(range(3, 11))  # exactly two full blocks
    first = Request(0, None, prompt, SamplingParams(temperature=0, max_tokens=1), frozenset())
    scheduler.add_request(first)
    step = scheduler.schedule()
    scheduler.update(step, runner.execute(step))
    assert scheduler.free_finished() == [first]
    second = Request(1, None, list(prompt), SamplingParams(temperature=0, max_tokens=1), frozenset())
    scheduler.add_request(second)
    step = scheduler.schedule()
    assert second.num_computed_tokens == 4, "one block reused, the last block recomputed"
    assert step.scheduled[0].num_new_tokens == 4
    assert manager.num_cache_hits == 4


def test_preemption_frees_newest_and_recomputes():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    runner = FakeRunner(4)
    requests = [Request(i, None, [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), frozenset()) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    finished = []
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
        finished += scheduler.free_finished()
    assert scheduler.num_preemptions > 0
    assert sorted(r.request_id for r in finished) == [0, 1, 2]
    assert all(len(r.output_token_ids) == 12 for r in requests)


def _run_to_completion(pool_blocks: int, lookahead_tokens: int, count: int = 6) -> tuple[int, int]:
    """(preemptions, requests admitted by the first step) for count requests of 5 + 20 tokens."""
    manager = BlockManager(pool_blocks, 4, enable_prefix_caching=False, lookahead_tokens=lookahead_tokens)
    scheduler = Scheduler(manager, max_num_seqs=count, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for index in range(count):
        scheduler.add_request(Request(index, None, [3 + index] * 5, params, frozenset()))
    admitted = None
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        admitted = len(step.scheduled) if admitted is None else admitted
        scheduler.update(step, runner.execute(step))
        scheduler.free_finished()
        _check_block_invariants(manager, scheduler.running)
    return scheduler.num_preemptions, admitted


def test_blocks_taken_ahead_never_cost_a_seat_or_a_preemption():
    blocks_each = 7  # 25 tokens in 4-token blocks
    # A pool that holds every request at its final length never preempts.
    assert _run_to_completion(blocks_each * 6, lookahead_tokens=64) == (0, 6)
    # A tight pool: blocks taken ahead are released to admit every prompt at once, and
    # to grow running requests, before anyone is preempted.
    without = _run_to_completion(16, lookahead_tokens=0)
    assert without[1] == 6
    assert _run_to_completion(16, lookahead_tokens=64) == without


def test_a_running_request_grows_into_blocks_another_took_ahead():
    """A takes blocks ahead for its 32 tokens; B, admitted later, needs three of the pool's ten.
    Without lookahead both fit as they grow; with it, B's growth must release A's blocks, not preempt."""
    manager = BlockManager(10, 4, enable_prefix_caching=False, lookahead_tokens=64)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(4)
    first = Request(0, None, [3] * 4, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True), frozenset())
    second = Request(1, None, [4] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), frozenset())
    scheduler.add_request(first)
    for step_index in range(100):
        if not scheduler.has_unfinished():
            break
        if step_index == 1:
            assert len(first.block_ids) == 8, "the first request took blocks ahead"
            scheduler.add_request(second)
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
        scheduler.free_finished()
        _check_block_invariants(manager, scheduler.running)
    assert not scheduler.has_unfinished()
    assert scheduler.num_preemptions == 0
    assert len(first.output_token_ids) == 28 and len(second.output_token_ids) == 8
