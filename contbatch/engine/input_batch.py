"""InputBatch: the model runner's own state of every sequence it runs, and the flat batch of a step.

Kept up to date from each ``SchedulerOutput`` (new sequences, block-table changes,
sequences that ended) and from the tokens the runner samples itself, as vLLM's
``InputBatch`` is; nothing here reads the scheduler's requests. A step's sequences are
flattened into one varlen batch with no padding: their new tokens are concatenated
into ``input_ids``/``positions``, and each sequence gets its context length and, per
KV-cache group, its block table and its tokens' cache slots (one AttentionMetadata per group).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from contbatch.engine.bad_words import BadWordsIds, banned_next
from contbatch.engine.scheduler_output import NewSeq, SchedulerOutput
from contbatch.engine.stopping import stop_token_ids
from contbatch.layers.attention import AttentionMetadata
from contbatch.layers.sampler import SamplingBatch, TokenMasks
from contbatch.sampling_params import SamplingParams

SHORT_CHUNK = 16  # chunks up to this many tokens get their cache slots computed in plain Python


@dataclass
class SeqState:
    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    stop_ids: frozenset[int]  # masked out until min_tokens are generated
    prompt_logprobs_from: int  # with prompt logprobs: the first prompt position scored
    generator: torch.Generator | None
    block_tables: list[list[int]]  # one per KV-cache group
    bad_words_ids: BadWordsIds = ()
    allowed_ids: torch.Tensor | None = None  # params.allowed_token_ids on the device, made once
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # params.logit_bias as (token ids, values), likewise
    lora_id: int = 0  # the LoRA adapter it runs with; 0 for none

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def stops_suppressed(self) -> bool:
        return bool(self.stop_ids) and self.num_output_tokens < self.params.min_tokens


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: list[AttentionMetadata]  # one per KV-cache group
    sample_rows: list[int]  # rows of the flattened batch whose logits are sampled, one per sampling sequence
    sampling_seqs: list[SeqState]
    prompt_rows: list[int] = field(default_factory=list)  # rows scored for prompt logprobs
    prompt_targets: list[tuple[SeqState, int]] = field(default_factory=list)  # (sequence, position of the scored token)
    row_adapters: list[tuple[int, int, int]] = field(default_factory=list)  # (LoRA id, first row, end row)


class InputBatch:
    def __init__(self, block_size: int, num_groups: int, eos_token_ids: frozenset[int], device: torch.device) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.seqs: dict[int, SeqState] = {}

    def update(self, step: SchedulerOutput) -> None:
        """Apply the step's changes: drop ended sequences, add new ones, update block tables."""
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            self.seqs[new.seq_id] = self._new_state(new)
        for item in step.scheduled:
            for table, (start, blocks) in zip(self.seqs[item.seq_id].block_tables, item.table_updates):
                table[start:] = blocks

    def append_sampled(self, seqs: list[SeqState], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)

    def prepare(self, step: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]  # per group
        tables: list[list[list[int]]] = [[] for _ in range(self.num_groups)]  # per group
        seq_lens, query_lens, sample_rows, sampling_seqs = [], [], [], []
        prompt_rows, prompt_targets, row_adapters = [], [], []
        size = self.block_size
        for item in step.scheduled:
            seq, start = self.seqs[item.seq_id], item.num_computed_tokens
            end = start + item.num_new_tokens
            first_row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if end - start == 1:  # a decode
                index, offset = divmod(start, size)
                for table, group_slots, group_tables in zip(seq.block_tables, slots, tables):
                    group_slots.append(table[index] * size + offset)
                    group_tables.append(table)
            else:
                chunk = np.arange(start, end) if end - start > SHORT_CHUNK else None
                for table, group_slots, group_tables in zip(seq.block_tables, slots, tables):
                    if chunk is None:  # short chunks: plain ints beat numpy's per-call cost
                        group_slots.extend(table[p // size] * size + p % size for p in range(start, end))
                    else:
                        blocks = np.asarray(table, dtype=np.int64)[chunk // size]
                        group_slots.extend((blocks * size + chunk % size).tolist())
                    group_tables.append(table)
            if seq.lora_id:
                row_adapters.append((seq.lora_id, first_row, len(input_ids)))
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            if seq.params.prompt_logprobs is not None:
                # Row of position p scores the prompt token at p + 1.
                for position in range(max(start, seq.prompt_logprobs_from - 1), min(end, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(first_row + position - start)
                    prompt_targets.append((seq, position + 1))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens_tensor = self._tensor(np.asarray(seq_lens, dtype=np.int32), torch.int32)
        query_start_tensor = self._tensor(query_start_loc, torch.int32)
        metadata = [
            AttentionMetadata(
                slot_mapping=self._tensor(np.asarray(group_slots, dtype=np.int64), torch.int64),
                block_tables=self._tensor(_padded(group_tables), torch.int32),
                seq_lens=seq_lens_tensor,
                query_start_loc=query_start_tensor,
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
            )
            for group_slots, group_tables in zip(slots, tables)
        ]
        return ModelInput(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64), torch.int64),
            positions=self._tensor(np.asarray(positions, dtype=np.int64), torch.int64),
            metadata=metadata,
            sample_rows=sample_rows,
            sampling_seqs=sampling_seqs,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
            row_adapters=row_adapters,
        )

    def sampling_batch(self, seqs: list[SeqState], masks: TokenMasks | None) -> SamplingBatch:
        suppressed, allowed, biases = [], [], []
        for row, s in enumerate(seqs):
            stops_suppressed = s.stops_suppressed
            if s.bad_words_ids or stops_suppressed:
                banned = banned_next(s.bad_words_ids, s.token_ids, s.num_output_tokens)
                if stops_suppressed:
                    banned.extend(s.stop_ids)
                if banned:
                    suppressed.append((row, banned))
            if s.allowed_ids is not None:
                allowed.append((row, s.allowed_ids))
            if s.bias is not None:
                biases.append((row, *s.bias))
        token_ids = [
            (s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :]) if s.params.has_penalties
            else ([], []) for s in seqs
        ]
        masked = None
        if masks is not None and masks.seq_ids:
            rows = {s.seq_id: row for row, s in enumerate(seqs)}
            masked = ([rows[seq_id] for seq_id in masks.seq_ids], masks.blocked)
        return SamplingBatch.build(
            [s.params for s in seqs], [s.generator for s in seqs], suppressed, masked, token_ids, self.device,
            allowed, biases,
        )

    def _new_state(self, new: NewSeq) -> SeqState:
        return SeqState(
            seq_id=new.seq_id,
            params=new.params,
            token_ids=list(new.token_ids),
            num_prompt_tokens=len(new.token_ids),
            stop_ids=stop_token_ids(new.params, self.eos_token_ids),
            prompt_logprobs_from=new.prompt_logprobs_from,
            generator=make_generator(new.params.seed, new.sample_index),
            block_tables=[[] for _ in range(self.num_groups)],
            bad_words_ids=new.bad_words_ids,
            allowed_ids=None if new.params.allowed_token_ids is None else torch.tensor(
                sorted(set(new.params.allowed_token_ids)), dtype=torch.int64, device=self.device),
            bias=self._bias_tensors(new.params.logit_bias),
            lora_id=new.lora_id,
        )

    def _bias_tensors(self, logit_bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not logit_bias:
            return None
        token_ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=self.device)
        return token_ids, torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=self.device)

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """The tables as rows of one int32 array, zero-padded to the longest."""
    array = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for row, table in enumerate(tables):
        array[row, : len(table)] = table
    return array


def make_generator(seed: int | None, sample_index: int) -> torch.Generator | None:
    """The sequence's own random stream, or None to use the engine's."""
    if seed is None:
        return None
    if sample_index:
        # Distinct, deterministic streams per sample; sample 0 uses the seed itself.
        seed = int(np.random.SeedSequence([seed, sample_index]).generate_state(1, dtype=np.uint64)[0] >> 1)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
