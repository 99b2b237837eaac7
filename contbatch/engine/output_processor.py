"""OutputProcessor: sampled tokens -> text, text-level stops, logprobs, and finished RequestOutputs.

Runs after the scheduler has appended each step's tokens. It detokenises
incrementally, ends requests on stop strings and finished grammars (which the
scheduler cannot see), and assembles the ``n`` samples of a prompt into one
RequestOutput once all of them are done.
"""

import logging

from transformers import PreTrainedTokenizerBase

from contbatch.engine.detokenizer import IncrementalDetokenizer
from contbatch.engine.request import Request
from contbatch.layers.logprobs import RawLogprobs
from contbatch.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[Request, IncrementalDetokenizer] = {}
        self.finished_samples: dict[int, list[Request]] = {}
        self._token_text: dict[int, str] = {}

    def process_token(self, request: Request, logprobs: RawLogprobs | None) -> None:
        """Account for the token the scheduler just appended to ``request``."""
        token = request.token_ids[-1]
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.append(self._to_token_logprobs(logprobs))
            request.cumulative_logprob += logprobs.logprob
        if request.grammar is not None and not request.is_finished:
            try:
                request.grammar.accept(token)
            except ValueError as exc:  # only an llguidance internal error gets past the mask
                logger.warning("request %d sample %d: %s (%s); ending it", request.request_id,
                               request.sample_index, exc, request.grammar.error)
                request.finish("abort", None)
            if request.grammar.is_finished:
                request.finish("stop", None)
        if self.tokenizer is None:
            return
        detokenizer = self.detokenizers.get(request)
        if detokenizer is None:
            detokenizer = self.detokenizers[request] = IncrementalDetokenizer(
                self.tokenizer, request.params.skip_special_tokens
            )
        delta = detokenizer.add(token)
        if delta and request.params.stop and not request.is_finished and not request.stops_suppressed:
            self._check_stop_strings(request, detokenizer, len(delta))

    def record_prompt_logprobs(self, entries: list[tuple[Request, int, RawLogprobs]]) -> None:
        for request, position, raw in entries:
            # Positions recomputed after a preemption are already recorded.
            if request.prompt_logprobs is not None and position == len(request.prompt_logprobs):
                request.prompt_logprobs.append(self._to_token_logprobs(raw))

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
        self.detokenizers.clear()
        self.finished_samples.clear()

    def _check_stop_strings(self, request: Request, detokenizer: IncrementalDetokenizer, delta_length: int) -> None:
        """End the request at the first stop string that the new text completes."""
        stops = request.params.stop
        window = delta_length + max(len(s) for s in stops) - 1
        search_from = max(0, len(detokenizer.text) - window)
        matches = [(detokenizer.text.find(s, search_from), s) for s in stops]
        matches = [(at, s) for at, s in matches if at >= 0]
        if not matches:
            return
        at, stop = min(matches)
        cut = at + len(stop) if request.params.include_stop_str_in_output else at
        detokenizer.truncate(cut)
        request.finish("stop", stop)

    def _request_output(self, samples: list[Request]) -> RequestOutput:
        first = samples[0]
        completions = [self._completion(r) for r in samples]
        return RequestOutput(
            request_id=str(first.request_id),
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=_merge_metrics(samples),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
        )

    def _completion(self, request: Request) -> CompletionOutput:
        detokenizer = self.detokenizers.pop(request, None)
        if detokenizer is not None:
            detokenizer.flush()
        return CompletionOutput(
            index=request.sample_index,
            text=detokenizer.text if detokenizer is not None else "",
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=request.logprobs,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        )

    def _to_token_logprobs(self, raw: RawLogprobs) -> TokenLogprobs:
        entries = {
            token: Logprob(value, rank, self._text(token))
            for rank, (token, value) in enumerate(zip(raw.top_ids, raw.top_logprobs), start=1)
        }
        entries[raw.token_id] = Logprob(raw.logprob, raw.rank, self._text(raw.token_id))
        return entries

    def _text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _merge_metrics(samples: list[Request]) -> RequestMetrics:
    first = samples[0].metrics
    first_tokens = [r.metrics.first_token_time for r in samples if r.metrics.first_token_time is not None]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min(first_tokens, default=None),
        finished_time=max(r.metrics.finished_time or 0.0 for r in samples),
        num_preemptions=sum(r.metrics.num_preemptions for r in samples),
    )
