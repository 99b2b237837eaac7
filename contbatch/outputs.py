"""What generate() returns: RequestOutput with one CompletionOutput per sample."""

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One generated completion.

    finish_reason is "stop" (EOS or a stop token) or "length" (max_tokens or max_model_len);
    stop_reason is the token id that stopped it, or None for EOS/length.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time() seconds) in a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The result for one prompt, in the order the prompts were given.

    ``error`` is set (and ``outputs`` empty) when the request could not run, e.g. a
    prompt from a lazy iterable that was longer than max_model_len.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
