"""Scheduler + block manager under random workloads, driven by a fake model runner.

The fake runner plays the KV cache: it writes (group, token, position) into every slot
the step assigns, in each KV-cache group's table, and checks that each scheduled
sequence's block tables map every context position its queries read (in a group with a
sliding window, those within the first query's window) to its own tokens. So any
bookkeeping error (a leaked, shared, evicted, mis-hashed or too early freed block) shows
up as a sequence attending to wrong K/V. The same holds for requests that continue from
kept ones (beam search's steps), rounds of them.
"""

import random
from collections.abc import Iterable
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from contbatch.engine.block_manager import BlockManager
from contbatch.engine.model_runner import copy_waves
from contbatch.engine.request import Request
from contbatch.engine.scheduler import Scheduler
from contbatch.engine.scheduler_output import SchedulerOutput
from contbatch.engine.stopping import Finish, stop_token_ids, token_finish
from contbatch.sampling_params import SamplingParams

EOS = 2
VOCAB = 50


@dataclass
class _FakeSeq:
    request_id: int
    sample_index: int
    token_ids: list[int]
    block_tables: list[list[int]]  # per group


class FakeRunner:
    """Keeps its own sequences from the scheduler's plain output, as the model runner does."""

    def __init__(self, block_size: int, group_windows: tuple[int, ...] = (-1,)) -> None:
        self.block_size = block_size
        self.group_windows = group_windows
        self.slots: dict[int, tuple[int, int, int]] = {}  # one pool: (group, token, position) per slot
        self.seqs: dict[int, _FakeSeq] = {}

    def execute(self, step: SchedulerOutput) -> dict[int, int]:
        for seq_id in step.finished_seq_ids:
            del self.seqs[seq_id]
        for new in step.new_seqs:
            assert new.seq_id not in self.seqs
            tables = [[] for _ in self.group_windows]
            self.seqs[new.seq_id] = _FakeSeq(new.request_id, new.sample_index, list(new.token_ids), tables)
        for wave in copy_waves(step.blocks_to_copy):
            self._copy_in_parallel(wave)
        sampled = {}
        for item in step.scheduled:
            seq = self.seqs[item.seq_id]
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            assert item.samples == (end == len(seq.token_ids))
            for group, (table, (table_start, blocks)) in enumerate(zip(seq.block_tables, item.table_updates)):
                table[table_start:] = blocks
                assert len(table) == -(-end // self.block_size), "not exactly the blocks of the step's tokens"
                for position in range(start, end):
                    self.slots[self._slot(table, position)] = (group, seq.token_ids[position], position)
                window = self.group_windows[group]
                for position in range(0 if window <= 0 else max(0, start - window + 1), end):
                    assert self.slots.get(self._slot(table, position)) == (group, seq.token_ids[position], position), (
                        f"request {seq.request_id} would attend to wrong K/V at position {position} in group {group}"
                    )
            if item.samples:
                sampled[item.seq_id] = _next_token(seq)
                seq.token_ids.append(sampled[item.seq_id])
        return sampled

    def _copy_in_parallel(self, wave: list[tuple[int, int]]) -> None:
        """As one copy_blocks call: every source read before any destination is written, which
        is the same as copying in order only if no block is written twice or read and written."""
        sources, destinations = [s for s, _ in wave], [d for _, d in wave]
        assert len(set(destinations)) == len(destinations), "a destination twice in one copy_blocks call"
        assert not set(sources) & set(destinations), "a block both read and written by one copy_blocks call"
        size = self.block_size
        read = [[self.slots.get(source * size + offset) for offset in range(size)] for source in sources]
        for destination, values in zip(destinations, read):
            for offset, value in enumerate(values):
                self.slots.pop(destination * size + offset, None)
                if value is not None:
                    self.slots[destination * size + offset] = value

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size


def _next_token(seq: _FakeSeq) -> int:
    """Deterministic per request, sample and length, with EOS now and then."""
    return (seq.request_id * 31 + seq.sample_index * 7 + len(seq.token_ids) * 17) % VOCAB


def _step(scheduler: Scheduler, runner: FakeRunner, finishes: dict[int, Finish] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: schedule, run, append, end requests on their tokens (as the output processor does)."""
    step = scheduler.schedule()
    ended = {}
    for request in scheduler.update(step, runner.execute(step)):
        stops = stop_token_ids(request.params, frozenset({EOS}))
        finish = token_finish(request.token_ids[-1], stops, request.params, request.num_output_tokens,
                              request.num_tokens, scheduler.max_model_len)
        if finish is not None:
            ended[request.seq_id] = finish
    if finishes is not None:
        finishes.update(ended)
    return step, scheduler.finish(ended)


def _add(scheduler: Scheduler, request_id: int, prompt: list[int], params: SamplingParams) -> Request:
    return scheduler.add_request(request_id, None, prompt, params)


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
    window = draw(st.integers(1, 24))
    return dict(
        group_windows=draw(st.sampled_from([(-1,), (window,), (window, -1), (-1, window, window)])),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(3, 8)),
        budget=draw(st.integers(1, 64)),
        prefix_caching=draw(st.booleans()),
        lookahead_tokens=draw(st.sampled_from([0, 1, 8, 512])),
        freed_block_reserve=draw(st.sampled_from([None, 0])),  # 0: a freed block is reused at once
        prompts=_prompts(draw, count),
        max_tokens=[draw(st.integers(1, 40)) for _ in range(count)],
        n=[draw(st.integers(1, 3)) for _ in range(count)],
        ignore_eos=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_exactly_once_with_consistent_cache(w):
    groups = w["group_windows"]
    # Pool blocks per group: one max_model_len sequence must fit in every group (as KVCacheSpec sizes it).
    manager = BlockManager(w["num_blocks"] * len(groups), w["block_size"], w["prefix_caching"], w["lookahead_tokens"],
                           w["freed_block_reserve"], group_windows=groups)
    scheduler = Scheduler(manager, w["max_num_seqs"], w["budget"], w["max_model_len"])
    runner = FakeRunner(w["block_size"], groups)
    for index, (prompt, max_tokens, n) in enumerate(zip(w["prompts"], w["max_tokens"], w["n"])):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=w["ignore_eos"], n=n)
        _add(scheduler, index, prompt, params)

    finished: list[Request] = []
    finishes: dict[int, Finish] = {}
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        step, ended = _step(scheduler, runner, finishes)
        assert not step.is_empty, "no progress with requests waiting"
        assert step.num_batched_tokens <= w["budget"]
        assert len(step.scheduled) <= w["max_num_seqs"]
        assert len({s.seq_id for s in step.scheduled}) == len(step.scheduled)
        finished.extend(ended)
        _check_block_invariants(manager, [r.seq_id for r in scheduler.running])
    assert not scheduler.has_unfinished()

    expected = sorted((i, s) for i, n in enumerate(w["n"]) for s in range(n))
    assert sorted((r.request_id, r.sample_index) for r in finished) == expected, "every sample finishes exactly once"
    for request in finished:
        assert request.prompt_token_ids == w["prompts"][request.request_id]
        _check_stopping(request, finishes[request.seq_id], w["max_model_len"])
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    assert all(count == 0 for count in manager.ref_counts)


def _run_round(scheduler: Scheduler, runner: FakeRunner, manager: BlockManager) -> list[Request]:
    finished = []
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return finished
        step, ended = _step(scheduler, runner)
        assert not step.is_empty, "no progress with requests waiting"
        finished.extend(ended)
        # Holders: running requests, kept ones, and continuations still waiting with their parents' blocks.
        _check_block_invariants(manager, [i for i in (*scheduler.requests, *scheduler.kept) if i in manager.seqs])
    raise AssertionError("the round did not finish")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_continuations_of_kept_requests_read_their_parents_kv_and_free_every_block(w, rounds, seed):
    """Rounds as beam search runs them: every request keeps its blocks once it has its one
    token; 0-2 continuations of each (its computed tokens and a new one) start from them,
    then the parents are released. A continuation whose parent is still kept computes only
    its last token; kept blocks are freed before any preemption when blocks run short."""
    groups, rng = w["group_windows"], random.Random(seed)
    manager = BlockManager(w["num_blocks"] * len(groups), w["block_size"], w["prefix_caching"], w["lookahead_tokens"],
                           w["freed_block_reserve"], group_windows=groups)
    scheduler = Scheduler(manager, w["max_num_seqs"], w["budget"], w["max_model_len"])
    runner = FakeRunner(w["block_size"], groups)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for index, prompt in enumerate(w["prompts"]):
        scheduler.add_request(index, None, prompt[: w["max_model_len"] - 1], params, keep_blocks=True)
    parents = _run_round(scheduler, runner, manager)
    next_id = len(w["prompts"])
    for _ in range(rounds):
        children = []
        for parent in parents:
            for _ in range(rng.randint(0, 2)):
                tokens = parent.token_ids[: parent.num_computed_tokens] + [rng.randint(3, VOCAB - 1)]
                if len(tokens) >= w["max_model_len"]:
                    continue
                was_kept = parent.seq_id in scheduler.kept
                child = scheduler.add_request(next_id, None, tokens, params, keep_blocks=True,
                                              parent_seq_id=parent.seq_id)
                assert child.num_computed_tokens == (len(tokens) - 1 if was_kept else 0)
                children.append(child)
                next_id += 1
        scheduler.release(parent.seq_id for parent in parents)
        parents = _run_round(scheduler, runner, manager)
        assert sorted(r.seq_id for r in parents) == sorted(c.seq_id for c in children), "each ran exactly once"
    scheduler.release(list(scheduler.kept))
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    assert all(count == 0 for count in manager.ref_counts)


def _check_stopping(request: Request, finish: Finish, max_model_len: int) -> None:
    outputs = request.output_token_ids
    assert len(outputs) >= 1
    expected_length = min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)
    if finish.reason == "stop":
        assert outputs[-1] == EOS and EOS not in outputs[:-1] and not request.params.ignore_eos
    else:
        assert finish.reason == "length"
        assert len(outputs) == expected_length
        assert request.params.ignore_eos or EOS not in outputs


def _check_block_invariants(manager: BlockManager, seq_ids: Iterable[int]) -> None:
    """Reference counts are the holders of each block (in one group only), the freed and
    untouched blocks are exactly the others, and the prefix cache's maps agree."""
    holders = [0] * manager.num_blocks
    owner: dict[int, int] = {}
    for seq_id in seq_ids:
        for group in range(manager.num_groups):
            for block in manager.block_ids(seq_id, group):
                holders[block] += 1
                assert owner.setdefault(block, group) == group, f"block {block} is in two groups"
    assert holders == manager.ref_counts, "reference counts differ from the blocks sequences hold"
    free = manager.free_block_ids()
    assert len(set(free)) == len(free) and set(free) == {b for b, count in enumerate(holders) if count == 0}
    assert manager.num_used_blocks == sum(count > 0 for count in holders)
    for group, cached in enumerate(manager.hash_to_block):
        for block_hash, block in cached.items():
            assert manager.block_hash[block] == block_hash and manager.block_group[block] == group


def test_prefix_cache_hit_is_capped_below_prompt_length():
    """A fully cached prompt still computes its last token (it needs logits)."""
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(4)
    prompt = list(range(3, 11))  # exactly two full blocks
    first = _add(scheduler, 0, prompt, SamplingParams(temperature=0, max_tokens=1))
    assert _step(scheduler, runner)[1] == [first]
    second = _add(scheduler, 1, list(prompt), SamplingParams(temperature=0, max_tokens=1))
    step = scheduler.schedule()
    assert second.num_computed_tokens == 4, "one block reused, the last block recomputed"
    assert step.scheduled[0].num_new_tokens == 4
    assert step.num_prefix_hit_tokens == 4


def test_preemption_frees_newest_and_recomputes():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    runner = FakeRunner(4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [_add(scheduler, i, [5, 6, 7], params) for i in range(3)]
    finished, preemptions = [], 0
    while scheduler.has_unfinished():
        step, ended = _step(scheduler, runner)
        finished += ended
        preemptions += step.num_preempted
    assert preemptions > 0
    assert sorted(r.request_id for r in finished) == [0, 1, 2]
    assert all(len(r.output_token_ids) == 12 for r in requests)


def _run_to_completion(pool_blocks: int, lookahead_tokens: int, count: int = 6) -> tuple[int, int]:
    """(preemptions, requests admitted by the first step) for count requests of 5 + 20 tokens."""
    manager = BlockManager(pool_blocks, 4, enable_prefix_caching=False, lookahead_tokens=lookahead_tokens)
    scheduler = Scheduler(manager, max_num_seqs=count, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for index in range(count):
        _add(scheduler, index, [3 + index] * 5, params)
    admitted, preemptions = None, 0
    while scheduler.has_unfinished():
        step, _ = _step(scheduler, runner)
        admitted = len(step.scheduled) if admitted is None else admitted
        preemptions += step.num_preempted
        _check_block_invariants(manager, [r.seq_id for r in scheduler.running])
    return preemptions, admitted


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
    first = _add(scheduler, 0, [3] * 4, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
    second, preemptions = None, 0
    for step_index in range(100):
        if not scheduler.has_unfinished():
            break
        if step_index == 1:
            assert len(manager.block_ids(first.seq_id)) == 8, "the first request took blocks ahead"
            second = _add(scheduler, 1, [4] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        preemptions += _step(scheduler, runner)[0].num_preempted
        _check_block_invariants(manager, [r.seq_id for r in scheduler.running])
    assert not scheduler.has_unfinished()
    assert preemptions == 0
    assert len(first.output_token_ids) == 28 and len(second.output_token_ids) == 8


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)).filter(lambda c: c[0] != c[1]), max_size=12))
def test_copy_waves_run_in_parallel_as_the_copies_run_in_order(copies):
    """Splitting ordered copies into copy_blocks calls: each call is safe to run in parallel,
    and running the calls one after another leaves every block as copying in order does."""
    in_order = list(range(8))  # block -> the block whose original content it holds
    for source, destination in copies:
        in_order[destination] = in_order[source]
    in_waves = list(range(8))
    waves = copy_waves(copies)
    for wave in waves:
        destinations = [d for _, d in wave]
        assert wave and len(set(destinations)) == len(destinations)
        assert not {s for s, _ in wave} & set(destinations)
        read = [in_waves[source] for source, _ in wave]
        for destination, content in zip(destinations, read):
            in_waves[destination] = content
    assert in_waves == in_order
    assert [c for wave in waves for c in wave] == copies
