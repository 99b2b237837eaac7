"""What generate() returns: RequestOutput with one CompletionOutput per sample, or, when it stops
part-way, GenerationInterrupted (an error) or GenerationCancelled (Ctrl-C) carrying the
outputs finished so far."""

from dataclasses import dataclass

from contbatch.lora.request import LoRARequest


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution, its rank (1 = most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""token id -> Logprob: the chosen token and the top-k alternatives at one position."""


@dataclass
class CompletionOutput:
    """One generated completion.

    finish_reason is "stop" (EOS, a stop token or string, or a finished structured output)
    or "length" (max_tokens or max_model_len), or "abort" (the structured-output grammar
    library failed internally, or the request's allowed_token_ids, bad_words, min_tokens and
    grammar left no token to sample; the text so far is kept and a warning logged); stop_reason is the stop token id or stop
    string that ended it, or None for EOS and length.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


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
    """The result for one prompt.

    ``request_id`` is the prompt's position in the input. ``prompt_logprobs`` has one
    entry per prompt token (None for the first). ``error`` is set (and ``outputs`` empty)
    when the request could not run, e.g. a prompt from a lazy iterable that was longer
    than max_model_len.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran with, as in vLLM


class GenerationInterrupted(Exception):
    """``LLM.generate()`` stopped part-way because an exception was raised while it ran (by the
    prompts iterable, or by the engine).

    ``outputs`` holds the RequestOutputs that finished before that, in input order; requests
    still running then were aborted and are not in it. The original exception is ``__cause__``.
    """

    def __init__(self, outputs: list[RequestOutput], cause: Exception) -> None:
        super().__init__(
            f"generation stopped after {len(outputs)} finished request(s) (kept in .outputs): "
            f"{type(cause).__name__}: {cause}"
        )
        self.outputs = outputs


class GenerationCancelled(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped ``LLM.generate()``: a KeyboardInterrupt, so code that catches
    ``Exception`` does not swallow it, that carries the finished requests.

    ``outputs`` holds the RequestOutputs that finished before it, in input order (including
    those of the step the Ctrl-C arrived in: a first Ctrl-C takes effect once the running
    step is done); requests still running were aborted and are not in it. In a notebook,
    after the traceback: ``sys.last_value.outputs``.
    """

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__(
            f"generation cancelled after {len(outputs)} finished request(s) (kept in .outputs; "
            "in a notebook: sys.last_value.outputs)"
        )
        self.outputs = outputs

