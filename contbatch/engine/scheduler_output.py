"""What the scheduler hands the model runner each step: plain data, no live requests.

The runner keeps its own state of every sequence (contbatch/engine/input_batch.py) and
updates it from these: sequences it has not seen, each scheduled sequence's token
counts and block-table changes (one table per KV-cache group), and the sequences that ended.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

from contbatch.engine.bad_words import BadWordsIds
from contbatch.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewSeq:
    """A sequence the runner has not seen: what it needs to keep its state."""

    seq_id: int
    request_id: int
    sample_index: int
    params: SamplingParams
    token_ids: tuple[int, ...]  # the prompt (a forked sample starts from it too)
    prompt_logprobs_from: int = 1  # with prompt logprobs: the first prompt position scored
    bad_words_ids: BadWordsIds = ()  # params.bad_words as token sequences
    lora_id: int = 0  # the LoRA adapter it runs with; 0 for none


class ScheduledSeq(NamedTuple):
    """One sequence's work in a step (a NamedTuple: hundreds are made per step)."""

    seq_id: int
    num_computed_tokens: int  # tokens already in the cache: this step computes the next ones
    num_new_tokens: int
    samples: bool  # the chunk reaches the end of the sequence's tokens, so a token is sampled
    # Per KV-cache group, (start, blocks): the runner keeps the first start entries of the
    # sequence's block table of that group and replaces the rest with blocks.
    table_updates: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass
class SchedulerOutput:
    """One step's work, consumed by the model runner."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # ended since the last step: drop their state
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    num_prefix_queried_tokens: int = 0  # prompt tokens of admitted requests, with prefix caching on
    num_prefix_hit_tokens: int = 0  # of those, tokens found in the prefix cache

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
