"""Scheduler: iteration-level (continuous) batching under one token budget per step.

There is no prefill phase or decode phase. Every request owns ``num_computed_tokens``
and each step gives it up to ``num_tokens - num_computed_tokens`` more from the
step's budget: running requests first (usually one decode token each, or the next
chunk of a long prompt), then waiting requests in arrival order (FCFS; with LoRA adapters,
a request whose adapter would make more than ``max_loras`` in the running batch is passed
over until one of them has no request left, as in vLLM). When the
block manager cannot give a running request its blocks, the blocks running
requests took ahead of their tokens are released first; if that is not enough, the
newest running request is preempted: its blocks are freed and it is recomputed later.

A request may ask to keep its blocks once finished (beam search: contbatch/beam_search.py),
and a new request may continue from such a kept one: it starts with the kept request's
computed tokens already in the cache, sharing its blocks (copy-on-write), so it computes only
what it adds. Kept blocks are a cache, not a promise: when blocks run short they are freed
(oldest first), and then those waiting continuations share, before any running request is
preempted; a continuation without them starts as any new request does (from the prefix cache).

The scheduler owns the requests (``Request``). What it hands on is plain data: a
``SchedulerOutput`` of sequence ids, token counts and block-table changes, from which
the model runner keeps its own batch state. Requests end only when the engine calls
``finish`` (the output processor decides when).
"""

import time
from collections import deque
from collections.abc import Iterable

from contbatch.engine.bad_words import BadWordsIds
from contbatch.engine.block_manager import BlockManager
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.scheduler_output import NewSeq, ScheduledSeq, SchedulerOutput
from contbatch.lora.request import LoRARequest
from contbatch.sampling_params import SamplingParams


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int = 1,
    ) -> None:
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}  # seq_id -> every waiting or running request
        self._next_seq_id = 0
        self._known_to_runner: set[int] = set()
        self._ended: list[int] = []  # seq ids the runner knows that ended since the last step
        self.kept: dict[int, Request] = {}  # seq_id -> finished request whose blocks are kept, oldest first

    def add_request(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_logprobs_from: int = 1,
        bad_words_ids: BadWordsIds = (),
        lora_request: LoRARequest | None = None,
        keep_blocks: bool = False,
        parent_seq_id: int | None = None,
    ) -> Request:
        """``keep_blocks``: keep the request's blocks once it finishes, until ``release``.
        ``parent_seq_id``: a kept request whose computed tokens start ``prompt_token_ids``; the
        new request shares their blocks (if the parent is no longer kept, it starts afresh)."""
        request = Request(self._new_seq_id(), request_id, prompt, prompt_token_ids, params, 0, prompt_logprobs_from,
                          bad_words_ids, lora_request)
        request.keep_blocks = keep_blocks
        if parent_seq_id is not None:
            self._continue_from(request, parent_seq_id)
        self.requests[request.seq_id] = request
        self.waiting.append(request)
        return request

    def release(self, seq_ids: Iterable[int]) -> None:
        """Free the blocks of kept requests (those no longer kept are skipped)."""
        for seq_id in seq_ids:
            if self.kept.pop(seq_id, None) is not None:
                self.block_manager.free(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def abort(self, seq_id: int) -> None:
        """Drop a request that has not run yet (its admission failed elsewhere)."""
        request = self.requests.pop(seq_id)
        self.waiting.remove(request)
        self.block_manager.free(seq_id)

    def abort_all(self) -> None:
        for request in [*self.running, *self.waiting, *self.kept.values()]:
            self.block_manager.free(request.seq_id)
        self.kept.clear()
        self._ended.extend(self._known_to_runner)
        self._known_to_runner.clear()
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_seq_ids=self._ended)
        self._ended = []
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        if output.num_preempted == 0:
            self._schedule_waiting(output, budget)
        output.blocks_to_copy = self.block_manager.take_pending_copies()
        return output

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance computed counts and append sampled tokens (``sampled``: seq_id -> token id);
        return the requests that got a token, in the step's order."""
        advanced = []
        for item in output.scheduled:
            request = self.requests[item.seq_id]
            request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_computed_blocks(request.seq_id, request.token_ids, request.num_computed_tokens)
            if request.samples_to_fork and request.num_computed_tokens == request.fork_point:
                self._fork_samples(request)
            token = sampled.get(item.seq_id)
            if token is not None:
                request.token_ids.append(token)
                advanced.append(request)
        return advanced

    def finish(self, seq_ids: Iterable[int]) -> list[Request]:
        """End running requests: release their blocks and take them out of the batch."""
        finished = [self.requests.pop(seq_id) for seq_id in seq_ids]
        if not finished:
            return finished
        for request in finished:
            request.status = RequestStatus.FINISHED
            if request.keep_blocks:
                self._keep(request)
            else:
                self.block_manager.free(request.seq_id)
            self._known_to_runner.discard(request.seq_id)
            self._ended.append(request.seq_id)
        self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _keep(self, request: Request) -> None:
        """Keep the blocks of the request's computed tokens (not those it took ahead)."""
        self.block_manager.release_lookahead([(request.seq_id, request.num_computed_tokens)])
        self.kept[request.seq_id] = request

    def _continue_from(self, request: Request, parent_seq_id: int) -> None:
        """The new request starts at its kept parent's computed tokens, sharing their blocks;
        at least its last token is left to compute, so that it samples."""
        parent = self.kept.get(parent_seq_id)
        if parent is None:
            return
        computed = min(parent.num_computed_tokens, request.num_tokens - 1)
        if request.token_ids[:computed] != parent.token_ids[:computed]:
            raise ValueError(f"request {request.request_id}'s tokens do not start with the computed tokens of the "
                             f"kept request it continues (seq {parent_seq_id})")
        self.block_manager.fork(parent.seq_id, request.seq_id, computed)
        request.num_computed_tokens = computed

    def _make_room(self, keep: Request | None = None) -> bool:
        """Free blocks without preempting a running request: those running requests took
        ahead, else the oldest kept request's, else those the newest waiting continuation
        (not ``keep``) shares with its parent, which then starts afresh. False when there
        were none."""
        if self.block_manager.release_lookahead(self._token_counts()):
            return True
        if self.kept:
            self.release([next(iter(self.kept))])
            return True
        for request in reversed(self.waiting):
            if request.num_computed_tokens and request is not keep:
                self.block_manager.free(request.seq_id)
                request.num_computed_tokens = 0
                return True
        return False

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _fork_samples(self, parent: Request) -> None:
        """Samples 1..n-1 share the parent's computed blocks; their first writes copy the shared partial block."""
        for index in range(1, parent.samples_to_fork + 1):
            child = parent.fork(self._new_seq_id(), index)
            self.block_manager.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
            self.requests[child.seq_id] = child
            self.running.append(child)
        parent.samples_to_fork = 0

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._tokens_to_compute(request), budget)
            if not self._allocate_or_preempt(request, num_new, output):
                break
            self._add_scheduled(output, request, num_new)
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        while not self._allocate(request, num_new):
            if self._make_room():
                continue
            victim = self.running.pop()
            self._preempt(victim)
            output.num_preempted += 1
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        # Samples still to be forked from running prompts hold their seats already.
        seats_taken = len(self.running) + sum(r.samples_to_fork for r in self.running)
        caching = self.block_manager.enable_prefix_caching
        adapters = {r.lora_id for r in self.running if r.lora_id}
        index = 0  # of the first waiting request not passed over
        while index < len(self.waiting) and budget > 0:
            request = self.waiting[index]
            if request.lora_id and request.lora_id not in adapters and len(adapters) >= self.max_loras:
                index += 1  # its adapter would be one too many this step
                continue
            if seats_taken + 1 + request.samples_to_fork > self.max_num_seqs:
                break
            continuation = request.num_computed_tokens > 0  # holding its parent's blocks already
            if continuation:
                cached, num_cached = [], request.num_computed_tokens
            else:
                cached = self._cached_prefix(request)
                num_cached = len(cached) * self.block_manager.block_size
            num_new = min(self._tokens_to_compute(request, num_cached), budget)
            if not self._allocate_for_waiting(request, num_cached, num_new, cached):
                break
            del self.waiting[index]
            if request.lora_id:
                adapters.add(request.lora_id)
            seats_taken += 1 + request.samples_to_fork
            if caching and not continuation:  # the prefix cache's statistics, not the kept blocks'
                output.num_prefix_queried_tokens += request.num_tokens
                output.num_prefix_hit_tokens += num_cached
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self.running.append(request)
            if request.samples_to_fork and num_cached == request.fork_point:
                self._fork_samples(request)
            self._add_scheduled(output, request, num_new)
            budget -= num_new

    def _cached_prefix(self, request: Request) -> list[tuple[int, ...]]:
        tokens = request.token_ids
        if request.params.prompt_logprobs is not None:  # positions from the first scored one on must be computed
            tokens = tokens[: request.prompt_logprobs_from]
        return self.block_manager.find_cached_prefix(request.seq_id, tokens, request.lora_id)

    def _allocate_for_waiting(
        self, request: Request, num_cached: int, num_new: int, cached: list[tuple[int, ...]]
    ) -> bool:
        """A waiting request is worth more than blocks others took ahead or kept: free them if needed."""
        while not self._allocate(request, num_new, num_cached, cached):
            if not self._make_room(keep=request):
                return False
        return True

    def _allocate(
        self, request: Request, num_new: int, num_computed: int | None = None, cached: list[tuple[int, ...]] = ()
    ) -> bool:
        computed = request.num_computed_tokens if num_computed is None else num_computed
        return self.block_manager.allocate(request.seq_id, computed, num_new, cached, request.final_num_tokens)

    def _token_counts(self) -> list[tuple[int, int]]:
        return [(r.seq_id, r.num_tokens) for r in self.running]

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        if request.seq_id not in self._known_to_runner:
            self._known_to_runner.add(request.seq_id)
            output.new_seqs.append(
                NewSeq(request.seq_id, request.request_id, request.sample_index, request.params,
                       tuple(request.prompt_token_ids), request.prompt_logprobs_from, request.bad_words_ids,
                       request.lora_id)
            )
        tables = self.block_manager.block_table_update(request.seq_id, end)
        output.scheduled.append(ScheduledSeq(request.seq_id, start, num_new, end == request.num_tokens, tables))

    @staticmethod
    def _tokens_to_compute(request: Request, num_computed: int | None = None) -> int:
        """Tokens still to compute; a prompt with samples to fork stops at the fork point first."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        remaining = request.num_tokens - computed
        if request.samples_to_fork and computed < request.fork_point:
            return min(remaining, request.fork_point - computed)
        return remaining
