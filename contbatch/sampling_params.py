"""SamplingParams: how one request's tokens are chosen and when it stops."""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_INT64 = 2**63 - 1
"""Largest value of the integer fields that reach a tensor or a C long (top_k, token ids, counts)."""
MAX_SEED = 2**64 - 1
"""Largest seed torch.Generator.manual_seed takes."""
MAX_FLOAT32 = 3.4028234663852886e38
"""Largest temperature: it is applied as a float32."""


@dataclass
class SamplingParams:
    """Sampling settings for one request (vLLM-compatible names).

    Attributes:
        temperature: 0 means greedy decoding; higher values flatten the distribution.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        min_p: drop tokens whose probability is below min_p times the most likely one's [0, 1].
        max_tokens: most tokens to generate (>= 1); None: until EOS, a stop condition or
            the end of the context (max_model_len), as in vLLM.
        min_tokens: EOS and stop ids are suppressed until this many tokens exist.
        stop_token_ids: extra token ids that end the request (the id stays in ``token_ids``;
            its text is left out of ``text``, as in vLLM, unless include_stop_str_in_output).
        ignore_eos: keep generating past EOS (benchmarks, fixed-length outputs).
        seed: per-request seed in [0, 2**64 - 1]: the same seed gives the same tokens whatever
            else runs in the batch.
            With n > 1, sample i uses a seed derived from (seed, i).
        n: number of completions for the prompt; the prompt is prefilled once and its KV
            blocks are shared between the samples (copy-on-write).
        stop: strings that end the completion when they appear in its text (matched on the
            detokenised text, across token boundaries); the text is cut before the match.
        include_stop_str_in_output: keep the matched stop string, or the text of the stop
            token (stop_token_ids, or EOS), at the end of the text.
        logprobs: return the log-probability of every generated token and the top-k
            alternatives (0 = the chosen token only), at most 20. They come from the
            model's raw distribution: log-softmax of the logits *before* penalties,
            temperature, top-k/top-p/min-p and structured-output masks.
        prompt_logprobs: likewise for every prompt token after the first (for scoring and
            perplexity). Requests asking for it skip the prefix cache.
        repetition_penalty: > 1 discourages tokens already in the prompt or output
            (HF/CTRL style: positive logits divided, negative multiplied).
        presence_penalty: subtracted once from the logit of every token already generated [-2, 2].
        frequency_penalty: subtracted per occurrence of a token already generated [-2, 2].
        structured_outputs: constrain the output to a choice, a regex or a JSON schema
            (a StructuredOutputsParams, or a dict such as {"choice": ["yes", "no"]})
            (a ``StructuredOutputsParams``).
        skip_special_tokens: leave special tokens out of the text.
        detokenize: False leaves ``text`` (and logprobs' ``decoded_token``) empty, for callers
            that read token ids only; stop strings need the text, so they need True.
        logit_bias: {token id: bias} added to those tokens' logits at every step, before the
            penalties (vLLM's order); ids may be decimal strings, as in a JSON object (the
            command line takes one: --logit-bias '{"13": -5}').
        allowed_token_ids: the only tokens the request may generate (a non-empty list).
        bad_words: words the request may not generate: each word is tokenized as at the start
            of a text and after a space, and the last token of each token sequence is masked
            whenever the output so far ends with the tokens before it (vLLM's rule).
        truncate_prompt_tokens: keep only the last k prompt tokens (left truncation, as vLLM);
            -1 keeps the last max_model_len - 1. None keeps the whole prompt.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and full range: TypeError/ValueError naming the field, the
        value and what is allowed. Runs at construction; the engine runs it again before serving
        the params, so a field changed afterwards is caught before any work too. Also turns
        ``stop`` and ``stop_token_ids`` into lists."""
        _check_number("temperature", self.temperature, lambda v: 0 <= v <= MAX_FLOAT32, "in [0, 3.4e38] (float32)")
        _check_number("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_int(
            "top_k", self.top_k, lambda v: v == -1 or 0 <= v <= MAX_INT64, "-1 (all tokens) or in [0, 2**63 - 1]"
        )
        _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lambda v: 1 <= v <= MAX_INT64, "None or >= 1 and <= 2**63 - 1")
        most = MAX_INT64 if self.max_tokens is None else self.max_tokens
        _check_int("min_tokens", self.min_tokens, lambda v: 0 <= v <= most, f"in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: 0 <= v <= MAX_SEED, "None or in [0, 2**64 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        _check_int("n", self.n, lambda v: 1 <= v <= MAX_INT64, ">= 1 and <= 2**63 - 1")
        self.stop = _stop_strings(self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lambda v: 0 <= v <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: 0 < v <= 10, "in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings are matched on the text, which detokenize=False leaves out: "
                             "use stop_token_ids, or detokenize=True")
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _bad_words(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                       lambda v: v == -1 or 1 <= v <= MAX_INT64, "None, -1 (max_model_len - 1) or >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias: object) -> dict[int, float] | None:
    """{token id: finite bias}; keys given as decimal strings (JSON objects' keys) become ints."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"SamplingParams.logit_bias must be a dict {{token id: bias}} or None, got {bias!r}")
    checked = {}
    for key, value in bias.items():
        token_id = int(key) if isinstance(key, str) and key.isdecimal() else key
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_INT64:
            raise ValueError(f"SamplingParams.logit_bias must be keyed by token ids (ints in [0, 2**63 - 1], or "
                             f"their decimal strings), got the key {key!r}")
        _check_number("logit_bias", value, lambda v: math.isfinite(v) and abs(v) <= MAX_FLOAT32,
                      f"a finite float32 for each token (token {token_id})")
        checked[token_id] = float(value)
    return checked


def _allowed_token_ids(token_ids: object) -> list[int] | None:
    if token_ids is None:
        return None
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"SamplingParams.allowed_token_ids must be None or a non-empty list of token ids, got {token_ids!r}")
    _check_token_ids("allowed_token_ids", token_ids)
    return list(token_ids)


def _bad_words(words: object) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"SamplingParams.bad_words must be None or a list of non-blank strings, got {words!r}")
    return list(dict.fromkeys(words))


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stop)


def _structured_outputs(value: object) -> Any:
    """A StructuredOutputsParams, or None; a dict with one of its fields (as a JSONL line or
    a config file gives it, e.g. {"choice": ["yes", "no"]}) is turned into one."""
    if value is None:
        return None
    from contbatch.structured_outputs import StructuredOutputsParams

    if isinstance(value, dict):
        unknown = sorted(set(value) - {"choice", "regex", "json"})
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs takes the keys choice, regex or json, got {unknown}")
        return StructuredOutputsParams(**value)
    if not isinstance(value, StructuredOutputsParams):
        raise TypeError(
            "SamplingParams.structured_outputs must be a StructuredOutputsParams(choice=..., regex=... or json=...) "
            f"or a dict with one of those keys, got {type(value).__name__}"
        )
    return value


def _check_number(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _check_token_ids(name: str, token_ids: list | tuple) -> None:
    for token_id in token_ids:
        _check_int(name, token_id, lambda v: 0 <= v <= MAX_INT64, "in [0, 2**63 - 1] (each id)")


def _check_int(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def with_overrides(base: SamplingParams, overrides: dict, where: str) -> SamplingParams:
    """``base`` with the fields ``overrides`` sets, validated as any SamplingParams; ValueError
    naming ``where`` (e.g. "'sampling_params'") and the known fields for an unknown one."""
    unknown = sorted(set(overrides) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown} in {where}; known: {sorted(SAMPLING_FIELDS)}")
    return dataclasses.replace(base, **overrides)
