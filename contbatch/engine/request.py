"""Request: one prompt's state as it moves through the scheduler."""

import enum
import time

import torch

from contbatch.outputs import RequestMetrics
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
    """

    def __init__(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.generator = _make_generator(params.seed)
        self.metrics = RequestMetrics(arrival_time=time.time())

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

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and finish the request if it hit a stop condition."""
        self.token_ids.append(token_id)
        if self.num_output_tokens == 1:
            self.metrics.first_token_time = time.time()
        if token_id in self.stop_ids and self.num_output_tokens > self.params.min_tokens:
            self._finish("stop", None if token_id not in self.params.stop_token_ids else token_id)
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self._finish("length", None)

    def _finish(self, reason: str, stop_reason: int | None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.time()


def _make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
