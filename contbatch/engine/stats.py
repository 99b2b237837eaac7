"""Engine statistics: what each step did, and running totals, for benchmarks, tests and users.

The engine fills one ``StepStats`` per step and hands it to every listener added with
``LLMEngine.add_stats_listener``; ``EngineStats`` keeps the totals. Nothing needs to
wrap or patch engine methods to observe it.
"""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StepStats:
    num_running: int  # sequences scheduled in the step
    num_waiting: int  # requests left waiting after scheduling
    num_scheduled_tokens: int
    num_sampled: int  # sequences that reached the end of their tokens and sampled one
    query_spans: tuple[tuple[int, int], ...]  # (first, end) positions computed, per scheduled sequence
    num_blocks_used: int  # KV blocks in use during the step
    num_blocks_total: int
    num_preemptions: int
    num_copied_blocks: int  # copy-on-write copies of shared blocks
    num_prefix_queried_tokens: int  # prompt tokens of requests admitted in the step (prefix caching on)
    num_prefix_hit_tokens: int  # of those, found in the prefix cache
    model_s: float  # model forward and logits
    step_s: float  # the whole step: schedule, prepare, forward, sample, outputs


StatsListener = Callable[[StepStats], None]


@dataclass
class EngineStats:
    """Totals since the engine was built."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_generated_tokens: int = 0

    def add(self, step: StepStats) -> None:
        self.num_steps += 1
        self.num_preemptions += step.num_preemptions
        self.num_prefix_queried_tokens += step.num_prefix_queried_tokens
        self.num_prefix_hit_tokens += step.num_prefix_hit_tokens
        self.num_generated_tokens += step.num_sampled

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens if self.num_prefix_queried_tokens else 0.0
