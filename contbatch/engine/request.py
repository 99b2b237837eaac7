"""Request: one sample of one prompt, as it moves through the scheduler."""

import enum
import time
from typing import Callable

import numpy as np
import torch

from contbatch.outputs import RequestMetrics, TokenLogprobs
from contbatch.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A prompt and its generated tokens.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the request
    needs a model step until it catches up with ``num_tokens``. That one counter
    covers prefill, chunked prefill, decode and recomputation after preemption.

    A prompt with ``n > 1`` starts as one request (sample 0); once its prompt is
    computed up to the last token, the scheduler forks samples 1..n-1 from it,
    sharing its KV blocks.
    """

    def __init__(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.generator = _make_generator(params.seed, sample_index)
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.samples_to_fork = params.n - 1 if sample_index == 0 else 0
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        # A GrammarMatcher when params.structured_outputs is set; each sample needs its own,
        # so the engine also leaves the factory that makes one for forked samples.
        self.grammar = None
        self.make_grammar: Callable[[], object] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def fork_point(self) -> int:
        """Computed tokens after which samples are forked: all of the prompt but its last token."""
        return self.num_prompt_tokens - 1

    @property
    def stops_suppressed(self) -> bool:
        """EOS, stop ids and stop strings are ignored until min_tokens are generated."""
        return self.num_output_tokens < self.params.min_tokens

    def fork(self, sample_index: int) -> "Request":
        """A new sample of the same prompt, at the same computed position (blocks are shared by the caller)."""
        child = Request(
            self.request_id, self.prompt, self.prompt_token_ids, self.params, self.eos_token_ids, sample_index
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        if self.make_grammar is not None:
            child.make_grammar = self.make_grammar
            child.grammar = self.make_grammar()  # forked before any output token: a fresh matcher
        return child

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and finish the request if it hit a token-level stop condition."""
        self.token_ids.append(token_id)
        if self.num_output_tokens == 1:
            self.metrics.first_token_time = time.time()
        if token_id in self.stop_ids and self.num_output_tokens > self.params.min_tokens:
            self.finish("stop", token_id if token_id in self.params.stop_token_ids else None)
        elif self.num_tokens >= max_model_len or (
            self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens
        ):
            self.finish("length", None)

    def finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.time()


def _make_generator(seed: int | None, sample_index: int) -> torch.Generator | None:
    if seed is None:
        return None
    if sample_index:
        # Distinct, deterministic streams per sample; sample 0 uses the seed itself.
        seed = int(np.random.SeedSequence([seed, sample_index]).generate_state(1, dtype=np.uint64)[0] >> 1)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
