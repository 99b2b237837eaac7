"""OutputProcessor: sampled tokens -> text, logprobs, the decision to end a request, and RequestOutputs.

The one place that ends requests: after the scheduler has appended a step's tokens,
it checks each new token against the token-level stops and the length limits
(contbatch/engine/stopping.py), the request's grammar (through the structured-output
manager) and its stop strings (on the incrementally detokenised text), and returns
the finishes for the engine to apply. It assembles the ``n`` samples of a prompt into
one RequestOutput once all of them are done. Its per-sequence state (text, logprobs,
finish reason, token times) is its own, keyed by seq_id.
"""

import logging
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contbatch.engine.detokenizer import IncrementalDetokenizer
from contbatch.engine.request import Request
from contbatch.engine.stopping import Finish, stop_token_ids, token_finish
from contbatch.layers.logprobs import RawLogprobs
from contbatch.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _SeqOutput:
    stop_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer or with detokenize=False
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None
    decode_logprobs: bool = True  # logprobs carry each token's text (detokenize=True)
    cumulative_logprob: float = 0.0
    finish: Finish | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        structured=None,  # a StructuredOutputManager, or None when no request uses grammars
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.structured = structured
        self.seqs: dict[int, _SeqOutput] = {}
        self.finished_samples: dict[int, list[Request]] = {}  # request_id -> its finished samples
        self._token_text: dict[int, str] = {}

    def process_token(self, request: Request, logprobs: RawLogprobs | None) -> Finish | None:
        """Account for the token the scheduler just appended to ``request``; the finish it causes, if any."""
        state = self._state(request)
        token = request.token_ids[-1]
        now = time.time()
        if request.num_output_tokens == 1:
            state.first_token_time = now
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(self._to_token_logprobs(logprobs, request.params.detokenize))
            state.cumulative_logprob += logprobs.logprob
        params = request.params
        finish = token_finish(
            token, state.stop_ids, params, request.num_output_tokens, request.num_tokens, self.max_model_len
        )
        if self.structured is not None:
            grammar_finish = self.structured.accept(request.seq_id, token)
            if finish is None or (grammar_finish is not None and grammar_finish.reason == "abort"):
                finish = grammar_finish  # a failed grammar outranks the EOS its mask forced
        # As in vLLM, a stop token's text is left out of the text unless asked for (its id stays).
        hidden = finish is not None and token in state.stop_ids and not params.include_stop_str_in_output
        if state.detokenizer is not None and not hidden:
            delta = state.detokenizer.add(token)
            suppressed = request.num_output_tokens < params.min_tokens
            if delta and params.stop and finish is None and not suppressed:
                finish = self._stop_string_finish(request, state.detokenizer, len(delta))
        if finish is not None:
            state.finish, state.finished_time = finish, now
        return finish

    def end_without_token(self, request: Request) -> Finish:
        """A sequence whose masks (allowed_token_ids, bad words, min_tokens, its grammar) left no
        token to sample this step ends as "abort", its text so far kept."""
        logger.warning("sequence %d: its allowed_token_ids, bad_words, min_tokens or grammar leave no token to "
                       "sample; ending it", request.seq_id)
        state = self._state(request)
        state.finish, state.finished_time = Finish("abort"), time.time()
        return state.finish

    def record_prompt_logprobs(self, entries: list[tuple[int, int, RawLogprobs]]) -> None:
        """(seq_id, position, logprobs) of prompt tokens scored in a step."""
        for seq_id, position, raw in entries:
            state = self.seqs.get(seq_id)
            # Positions recomputed after a preemption are already recorded.
            if state is not None and state.prompt_logprobs is not None and position == len(state.prompt_logprobs):
                state.prompt_logprobs.append(self._to_token_logprobs(raw, state.decode_logprobs))

    def start(self, request: Request) -> None:
        """Begin the request's state (its prompt logprobs arrive before any token)."""
        self._state(request)

    def collect(self, finished: list[Request]) -> list[RequestOutput]:
        """RequestOutputs of prompts whose every sample has now finished."""
        outputs = []
        for request in finished:
            samples = self.finished_samples.setdefault(request.request_id, [])
            samples.append(request)
            if len(samples) == request.params.n:
                del self.finished_samples[request.request_id]
                outputs.append(self._request_output(sorted(samples, key=lambda r: r.sample_index)))
        return outputs

    def abort_all(self) -> None:
        self.seqs.clear()
        self.finished_samples.clear()

    def _state(self, request: Request) -> _SeqOutput:
        state = self.seqs.get(request.seq_id)
        if state is None:
            params = request.params
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            state = self.seqs[request.seq_id] = _SeqOutput(
                stop_ids=stop_token_ids(params, self.eos_token_ids),
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] * request.prompt_logprobs_from
                if params.prompt_logprobs is not None and request.sample_index == 0 else None,
                decode_logprobs=params.detokenize,
            )
        return state

    def _stop_string_finish(self, request: Request, detokenizer: IncrementalDetokenizer, delta_length: int) -> Finish | None:
        """The first stop string that the new text completes, with the text cut there."""
        stops = request.params.stop
        window = delta_length + max(len(s) for s in stops) - 1
        search_from = max(0, len(detokenizer.text) - window)
        matches = [(detokenizer.text.find(s, search_from), s) for s in stops]
        matches = [(at, s) for at, s in matches if at >= 0]
        if not matches:
            return None
        at, stop = min(matches)
        cut = at + len(stop) if request.params.include_stop_str_in_output else at
        detokenizer.truncate(cut)
        return Finish("stop", stop)

    def _request_output(self, samples: list[Request]) -> RequestOutput:
        first = samples[0]
        states = [self.seqs.pop(r.seq_id) for r in samples]
        return RequestOutput(
            request_id=str(first.request_id),
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[_completion(r, s) for r, s in zip(samples, states)],
            finished=True,
            metrics=_merge_metrics(samples, states),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=states[0].prompt_logprobs,
            lora_request=first.lora_request,
        )

    def _to_token_logprobs(self, raw: RawLogprobs, decode: bool) -> TokenLogprobs:
        entries = {
            token: Logprob(value, rank, self._text(token, decode))
            for rank, (token, value) in enumerate(zip(raw.top_ids, raw.top_logprobs), start=1)
        }
        entries[raw.token_id] = Logprob(raw.logprob, raw.rank, self._text(raw.token_id, decode))
        return entries

    def _text(self, token_id: int, decode: bool) -> str | None:
        if self.tokenizer is None or not decode:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _completion(request: Request, state: _SeqOutput) -> CompletionOutput:
    if state.detokenizer is not None:
        state.detokenizer.flush()
    finish = state.finish or Finish("abort")
    return CompletionOutput(
        index=request.sample_index,
        text=state.detokenizer.text if state.detokenizer is not None else "",
        token_ids=request.output_token_ids,
        finish_reason=finish.reason,
        stop_reason=finish.stop_reason,
        logprobs=state.logprobs,
        cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
    )


def _merge_metrics(samples: list[Request], states: list[_SeqOutput]) -> RequestMetrics:
    first = samples[0]
    first_tokens = [s.first_token_time for s in states if s.first_token_time is not None]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min(first_tokens, default=None),
        finished_time=max(s.finished_time or 0.0 for s in states),
        num_preemptions=sum(r.num_preemptions for r in samples),
    )
