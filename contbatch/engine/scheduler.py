"""Scheduler: iteration-level (continuous) batching under one token budget per step.

There is no prefill phase or decode phase. Every request owns ``num_computed_tokens``
and each step gives it up to ``num_tokens - num_computed_tokens`` more from the
step's budget: running requests first (usually one decode token each, or the next
chunk of a long prompt), then waiting requests in arrival order (FCFS). When the
block manager cannot give a running request its blocks, the blocks running
requests took ahead of their tokens are released first; if that is not enough, the
newest running request is preempted: its blocks are freed and it is recomputed later.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from contbatch.engine.block_manager import BlockManager
from contbatch.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's work, consumed by the model runner."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        for request in self.running:
            self.block_manager.free(request)
        self.running.clear()
        self.waiting.clear()

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        if output.num_preempted == 0:
            self._schedule_waiting(output, budget)
        output.blocks_to_copy = self.block_manager.take_pending_copies()
        return output

    def update(self, output: SchedulerOutput, sampled: dict[Request, int]) -> list[Request]:
        """Advance computed counts and append sampled tokens; return the requests that got a token.

        Finished requests stay in ``running`` until free_finished(), so the engine can
        still end requests on text-level conditions (stop strings, grammars) first.
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_computed_blocks(request)
            if request.samples_to_fork and request.num_computed_tokens == request.fork_point:
                self._fork_samples(request)
            token = sampled.get(request)
            if token is not None:
                request.append_token(token, self.max_model_len)
                advanced.append(request)
        return advanced

    def free_finished(self) -> list[Request]:
        """Remove finished requests from the running batch and release their blocks."""
        finished = [r for r in self.running if r.is_finished]
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for request in finished:
                self.block_manager.free(request)
        return finished

    def _fork_samples(self, parent: Request) -> None:
        """Samples 1..n-1 share the parent's computed blocks; their first writes copy the shared partial block."""
        for index in range(1, parent.samples_to_fork + 1):
            child = parent.fork(index)
            self.block_manager.fork(parent, child)
            self.running.append(child)
        parent.samples_to_fork = 0

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._tokens_to_compute(request), budget)
            if not self._allocate_or_preempt(request, num_new, output):
                break
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_new):
            if self.block_manager.release_lookahead(self.running):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            output.num_preempted += 1
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        # Samples still to be forked from running prompts hold their seats already.
        seats_taken = len(self.running) + sum(r.samples_to_fork for r in self.running)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if seats_taken + 1 + request.samples_to_fork > self.max_num_seqs:
                break
            cached = self.block_manager.find_cached_prefix(request)
            request.num_computed_tokens = len(cached) * self.block_manager.block_size
            num_new = min(self._tokens_to_compute(request), budget)
            if not self._allocate_for_waiting(request, num_new, cached):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seats_taken += 1 + request.samples_to_fork
            num_cached = request.num_computed_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            self.running.append(request)
            if request.samples_to_fork and num_cached == request.fork_point:
                self._fork_samples(request)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _allocate_for_waiting(self, request: Request, num_new: int, cached: list[int]) -> bool:
        """A waiting request is worth more than blocks others took ahead: release them if needed."""
        if self.block_manager.allocate_slots(request, num_new, cached):
            return True
        return bool(self.block_manager.release_lookahead(self.running)) and self.block_manager.allocate_slots(
            request, num_new, cached
        )

    @staticmethod
    def _tokens_to_compute(request: Request) -> int:
        """Tokens still to compute; a prompt with samples to fork stops at the fork point first."""
        remaining = request.num_tokens - request.num_computed_tokens
        if request.samples_to_fork and request.num_computed_tokens < request.fork_point:
            return min(remaining, request.fork_point - request.num_computed_tokens)
        return remaining
