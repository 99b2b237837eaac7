"""Beam search, as vLLM's offline ``LLM.beam_search``: the best ``beam_width`` continuations of
each prompt by summed log-probability, length-penalised.

Each step runs every live beam of every prompt as one request of one token, all in one
batch, asking for the top ``2 * beam_width`` log-probabilities (of the raw distribution, as
all logprobs here). A beam's candidates are itself extended by each of those
tokens; a candidate ending in an EOS token is complete (unless ``ignore_eos``), the others
compete, and the ``beam_width`` best by score go on. After ``max_tokens`` steps (or once no
beam is live) the complete and the live beams are ranked together and the best
``beam_width`` returned. The score is vLLM's (and HF's): the summed log-probability over the
sequence length (prompt included, a final EOS not counted) to the power ``length_penalty``.

Each step's requests keep their K/V once finished (``Step``), and the next step's beams
continue from their parent's: a beam computes one token a step, sharing its parent's blocks
(copy-on-write), whatever the prefix cache holds. Before, each step was a ``generate`` of
whole sequences that shared full blocks through the prefix cache, so each beam recomputed its
partial last block every step: 8,593 tokens computed for 1,024 generated in
benchmarks/beam_search.py (8 prompts, width 4, 32 tokens).
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from contbatch.lora.request import LoRARequest
from contbatch.outputs import RequestOutput, TokenLogprobs
from contbatch.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams.

    Attributes:
        beam_width: beams kept per prompt, and sequences returned (1 to 10: each step asks
            for 2 x beam_width log-probabilities, at most 20, as vLLM's default max_logprobs).
        max_tokens: most tokens a beam generates (int >= 1).
        ignore_eos: keep extending beams past EOS tokens instead of completing them.
        temperature: accepted for vLLM's signature; the scores are the raw distribution's
            log-probabilities (as vLLM v1's), so it changes nothing (float >= 0).
        length_penalty: the exponent of the sequence length that divides a beam's summed
            log-probability (1.0: the mean; 0.0: the plain sum).
        include_stop_str_in_output: accepted for vLLM's signature; beam search has no stop
            strings.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an int >= 1, got {value!r}")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"BeamSearchParams.beam_width must be at most {MAX_LOGPROBS // 2} (each step ranks "
                             f"2 x beam_width candidates a beam, of at most {MAX_LOGPROBS} served), "
                             f"got {self.beam_width}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BeamSearchParams.{name} must be a bool, got {getattr(self, name)!r}")
        for name, low in (("temperature", 0.0), ("length_penalty", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"BeamSearchParams.{name} must be a finite number, got {value!r}")
            if low is not None and value < low:
                raise ValueError(f"BeamSearchParams.{name} must be >= {low}, got {value!r}")


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` include the prompt's (as vLLM's); ``logprobs`` has one entry per
    generated token: the top ``2 * beam_width`` alternatives at that position. ``text`` is
    the decoded ``tokens``, prompt included (as vLLM's), None without a tokenizer."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class BeamStepInput:
    """One beam for a step: its tokens, its adapter, and the handle of its parent's kept K/V
    (all its tokens but the last; None at the first step, whose beams are the prompts)."""

    tokens: list[int]
    lora_request: LoRARequest | None
    context: int | None


Step = Callable[[list[BeamStepInput], SamplingParams], list[tuple[RequestOutput, int]]]
"""Runs one request a beam with the step's params (one token, its top logprobs), each
continuing from its ``context``, which the step then releases; returns each beam's output and
the handle of its K/V, kept for the next step's continuations."""

Release = Callable[[Iterable[int]], None]
"""Frees kept K/V by handle."""

_Live = tuple[BeamSearchSequence, int | None]
"""A live beam and the handle of the kept K/V it continues from (None: its prompt's first step)."""


class BeamSearch:
    """The search over a list of tokenized prompts; ``run`` returns their outputs in order."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.tokens[-1] in self.eos_token_ids else 0)
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty

    def run(self, prompts: Sequence[list[int]], loras: Sequence[LoRARequest | None], step: Step, release: Release,
            decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """Each live beam is held with the handle of the K/V it continues from (its parent's,
        kept by ``step``); handles no live beam holds are released after each step, the rest
        once the search ends."""
        live: list[list[_Live]] = [[(BeamSearchSequence(list(tokens), lora_request=lora), None)]
                                   for tokens, lora in zip(prompts, loras)]
        complete: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        step_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False,
                                     logprobs=2 * self.params.beam_width)
        try:
            for _ in range(self.params.max_tokens):
                for beams, done in zip(live, complete):  # a beam that fills the context ends there
                    done.extend(beam for beam, _ in beams if len(beam.tokens) >= self.max_model_len)
                    beams[:] = [(beam, kv) for beam, kv in beams if len(beam.tokens) < self.max_model_len]
                batch = [pair for beams in live for pair in beams]
                if not batch:
                    break
                results = step([BeamStepInput(beam.tokens, beam.lora_request, kv) for beam, kv in batch], step_params)
                failed = next((output.error for output, _ in results if output.error is not None), None)
                if failed is not None:
                    raise RuntimeError(f"a beam search step could not run: {failed}")
                stepped = iter(results)
                for index, beams in enumerate(live):
                    live[index] = self._next_beams([(beam, *next(stepped)) for beam, _ in beams], complete[index])
                release({kv for _, kv in results} - {kv for beams in live for _, kv in beams})
        finally:
            release({kv for beams in live for _, kv in beams if kv is not None})
        return [self._best(done + [beam for beam, _ in beams], decode) for beams, done in zip(live, complete)]

    def _next_beams(self, stepped: list[tuple[BeamSearchSequence, RequestOutput, int]],
                    complete: list[BeamSearchSequence]) -> list[_Live]:
        """Every beam extended by each of its step's candidates: EOS ones to ``complete``, the
        ``beam_width`` best of the others returned with the handle of the beam's kept K/V."""
        candidates = []
        for beam, output, kv in stepped:
            step = output.outputs[0].logprobs[0]
            for token, logprob in step.items():
                extended = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.lora_request,
                                              beam.cum_logprob + logprob.logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    complete.append(extended)
                else:
                    candidates.append((extended, kv))
        return sorted(candidates, key=lambda pair: self.score(pair[0]), reverse=True)[: self.params.beam_width]

    def _best(self, beams: list[BeamSearchSequence], decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
        best = sorted(beams, key=self.score, reverse=True)[: self.params.beam_width]
        for beam in best:
            beam.finish_reason = "stop" if beam.tokens[-1] in self.eos_token_ids and not self.params.ignore_eos \
                else "length"
            beam.text = decode(beam.tokens) if decode is not None else None
        return BeamSearchOutput(best)

