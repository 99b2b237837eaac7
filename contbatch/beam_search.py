"""Beam search, as vLLM's offline ``LLM.beam_search``: the best ``beam_width`` continuations of
each prompt by summed log-probability, length-penalised.

Each step runs every live beam of every prompt as one request of one token in one
``generate`` call, asking for the top ``2 * beam_width`` log-probabilities (of the raw
distribution, as all logprobs here). A beam's candidates are itself extended by each of those
tokens; a candidate ending in an EOS token is complete (unless ``ignore_eos``), the others
compete, and the ``beam_width`` best by score go on. After ``max_tokens`` steps (or once no
beam is live) the complete and the live beams are ranked together and the best
``beam_width`` returned. The score is vLLM's (and HF's): the summed log-probability over the
sequence length (prompt included, a final EOS not counted) to the power ``length_penalty``.

A beam's tokens are its prompt's plus its own, so consecutive steps share all but the last
KV block with the step before through the prefix cache: a step computes a partial block of
each beam, not its whole sequence.
"""

import math
from collections.abc import Callable, Sequence
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


Generate = Callable[[list[dict], SamplingParams, list[LoRARequest | None]], list[RequestOutput]]
"""One batch of one-token requests: LLM.generate without a progress bar."""


class BeamSearch:
    """The search over a list of tokenized prompts; ``run`` returns their outputs in order."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.tokens[-1] in self.eos_token_ids else 0)
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty

    def run(self, prompts: Sequence[list[int]], loras: Sequence[LoRARequest | None], generate: Generate,
            decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        live = [[BeamSearchSequence(list(tokens), lora_request=lora)] for tokens, lora in zip(prompts, loras)]
        complete: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        step_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False,
                                     logprobs=2 * self.params.beam_width)
        for _ in range(self.params.max_tokens):
            for beams, done in zip(live, complete):  # a beam that fills the context ends there
                done.extend(beam for beam in beams if len(beam.tokens) >= self.max_model_len)
                beams[:] = [beam for beam in beams if len(beam.tokens) < self.max_model_len]
            batch = [beam for beams in live for beam in beams]
            if not batch:
                break
            outputs = generate([{"prompt_token_ids": beam.tokens} for beam in batch], step_params,
                               [beam.lora_request for beam in batch])
            failed = next((output.error for output in outputs if output.error is not None), None)
            if failed is not None:
                raise RuntimeError(f"a beam search step could not run: {failed}")
            steps = iter(output.outputs[0].logprobs[0] for output in outputs)
            for index, beams in enumerate(live):
                live[index] = self._next_beams(beams, [next(steps) for _ in beams], complete[index])
        results = []
        for beams, done in zip(live, complete):
            best = sorted(done + beams, key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.finish_reason = "stop" if beam.tokens[-1] in self.eos_token_ids and not self.params.ignore_eos \
                    else "length"
                beam.text = decode(beam.tokens) if decode is not None else None
            results.append(BeamSearchOutput(best))
        return results

    def _next_beams(self, beams: list[BeamSearchSequence], steps: list[TokenLogprobs],
                    complete: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        """Every beam extended by each of its step's candidates: EOS ones to ``complete``, the
        ``beam_width`` best of the others returned."""
        candidates = []
        for beam, step in zip(beams, steps):
            for token, logprob in step.items():
                extended = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.lora_request,
                                              beam.cum_logprob + logprob.logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    complete.append(extended)
                else:
                    candidates.append(extended)
        return sorted(candidates, key=self.score, reverse=True)[: self.params.beam_width]
