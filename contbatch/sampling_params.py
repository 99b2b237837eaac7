"""SamplingParams: how one request's tokens are chosen and when it stops."""

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings for one request (vLLM-compatible names).

    Attributes:
        temperature: 0 means greedy decoding; higher values flatten the distribution.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        min_p: drop tokens whose probability is below min_p times the most likely one's [0, 1].
        max_tokens: most tokens to generate (>= 1).
        min_tokens: EOS and stop ids are suppressed until this many tokens exist.
        stop_token_ids: extra token ids that end the request (kept in the output).
        ignore_eos: keep generating past EOS (benchmarks, fixed-length outputs).
        seed: per-request seed: the same seed gives the same tokens whatever else runs in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, lambda v: math.isfinite(v) and v >= 0, ">= 0 and finite")
        _check_number("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_int("top_k", self.top_k, lambda v: v == -1 or v >= 0, "-1 (all tokens) or >= 0")
        _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_int("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1")
        _check_int("min_tokens", self.min_tokens, lambda v: 0 <= v <= self.max_tokens, f"in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: v >= 0, ">= 0 or None")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, lambda v: v >= 0, "a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number {allowed}, got {value!r}")
    if not ok(float(value)):
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")
