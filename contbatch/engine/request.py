"""Request: one sample of one prompt, as the scheduler sees it.

The scheduler owns every field that changes here (computed tokens, status, the token
list it appends sampled tokens to, fork and preemption counts). Other modules keep
their own per-sequence state keyed by ``seq_id``: the block manager its blocks, the
model runner its batch rows and generators, the output processor its text, logprobs
and finish reason, the structured-output manager its grammar matchers.
"""

import enum
import time

from contbatch.engine.bad_words import BadWordsIds
from contbatch.lora.request import LoRARequest
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
    sharing its KV blocks. Each sample has its own ``seq_id``; ``request_id`` is the
    prompt's.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sample_index: int = 0,
        prompt_logprobs_from: int = 1,
        bad_words_ids: BadWordsIds = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # With prompt logprobs: the first prompt position scored; the prefix before it may come from the cache.
        self.prompt_logprobs_from = prompt_logprobs_from
        self.bad_words_ids = bad_words_ids  # params.bad_words as token sequences (the engine tokenizes them)
        self.lora_request = lora_request  # the LoRA adapter it runs with; None for the base model
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.samples_to_fork = params.n - 1 if sample_index == 0 else 0
        self.arrival_time = time.time()
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.keep_blocks = False  # once finished, its K/V blocks stay for continuations (Scheduler.kept)

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
    def lora_id(self) -> int:
        """The adapter's lora_int_id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def final_num_tokens(self) -> int | None:
        """The most tokens the request can reach through max_tokens (None: no limit but the context)."""
        max_tokens = self.params.max_tokens
        return None if max_tokens is None else self.num_prompt_tokens + max_tokens

    def fork(self, seq_id: int, sample_index: int) -> "Request":
        """A new sample of the same prompt, at the same computed position."""
        child = Request(seq_id, self.request_id, self.prompt, self.prompt_token_ids, self.params, sample_index,
                        self.prompt_logprobs_from, self.bad_words_ids, self.lora_request)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.arrival_time = self.arrival_time
        child.first_scheduled_time = self.first_scheduled_time
        return child
