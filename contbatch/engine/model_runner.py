"""ModelRunner: owns the model and the KV cache tensors; turns a step into tokens.

A step's requests are flattened into one varlen batch with no padding: their new
tokens are concatenated into ``input_ids``/``positions``, each token gets its cache
slot, and each sequence its block table and context length. Logits are computed
only for the last token of requests that reach the end of their tokens (plus every
prompt position of requests that asked for prompt logprobs).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from contbatch import ops
from contbatch.engine.request import Request
from contbatch.engine.scheduler import SchedulerOutput
from contbatch.layers.attention import AttentionMetadata
from contbatch.layers.logprobs import RawLogprobs, compute_logprobs
from contbatch.layers.sampler import SamplingBatch, sample
from contbatch.models.config import ModelConfig

PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: list[int]  # rows of the flattened batch whose logits are sampled, one per sampling request
    sampling_requests: list[Request]
    prompt_rows: list[int] = field(default_factory=list)  # rows scored for prompt logprobs
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (request, position of the scored token)


@dataclass
class StepResult:
    sampled: dict[Request, int] = field(default_factory=dict)
    logprobs: dict[Request, RawLogprobs] = field(default_factory=dict)
    prompt_logprobs: list[tuple[Request, int, RawLogprobs]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (config.num_layers, 2, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return config.num_layers * 2 * config.num_kv_heads * block_size * config.head_dim * element

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run one step: the sampled token of every request that produced one, and requested logprobs."""
        if step.blocks_to_copy:
            mapping = torch.tensor(step.blocks_to_copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)
        model_input = self.prepare_input(step)
        hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata)
        result = StepResult()
        if model_input.prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(hidden, model_input.prompt_rows, model_input.prompt_targets)
        if not model_input.sample_rows:
            return result
        requests = model_input.sampling_requests
        sample_logits = self._logits(hidden, model_input.sample_rows)
        wants_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logits = sample_logits[wants_logprobs].float() if wants_logprobs else None  # a copy
        tokens = sample(sample_logits, self._sampling_batch(requests), self.generator)
        if raw_logits is not None:
            chosen = tokens[wants_logprobs]
            ks = [requests[i].params.logprobs for i in wants_logprobs]
            for i, raw in zip(wants_logprobs, compute_logprobs(raw_logits, chosen, ks)):
                result.logprobs[requests[i]] = raw
        result.sampled = dict(zip(requests, tokens.tolist()))
        return result

    def prepare_input(self, step: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        seq_lens, query_lens, sample_rows, sampling_requests = [], [], [], []
        prompt_rows, prompt_targets = [], []
        tables: list[list[int]] = []
        for item in step.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            first_row = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            token_positions = np.arange(start, end)
            positions.append(token_positions)
            tables.append(request.block_ids[: -(-end // self.block_size)])  # not the blocks taken ahead
            blocks = np.asarray(tables[-1], dtype=np.int64)
            slots.append(blocks[token_positions // self.block_size] * self.block_size + token_positions % self.block_size)
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            if request.prompt_logprobs is not None:
                # Row of position p scores the prompt token at p + 1.
                for position in range(start, min(end, request.num_prompt_tokens - 1)):
                    prompt_rows.append(first_row + position - start)
                    prompt_targets.append((request, position + 1))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling_requests.append(request)
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots), torch.int64),
            block_tables=self._tensor(block_tables, torch.int32),
            seq_lens=self._tensor(np.asarray(seq_lens, dtype=np.int32), torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64), torch.int64),
            positions=self._tensor(np.concatenate(positions), torch.int64),
            metadata=metadata,
            sample_rows=sample_rows,
            sampling_requests=sampling_requests,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
        )

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of the given rows in the model's dtype (the sampler makes fp32 copies as needed)."""
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[int], targets: list[tuple[Request, int]]
    ) -> list[tuple[Request, int, RawLogprobs]]:
        """Scored in chunks: a full-vocabulary fp32 row is ~200 KB for a 50k vocabulary."""
        scored = []
        for begin in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            chunk = targets[begin : begin + PROMPT_LOGPROBS_CHUNK]
            logits = self._logits(hidden, rows[begin : begin + PROMPT_LOGPROBS_CHUNK])
            token_ids = torch.tensor([r.token_ids[p] for r, p in chunk], device=self.device)
            raws = compute_logprobs(logits.float(), token_ids, [r.params.prompt_logprobs for r, _ in chunk])
            scored.extend((request, position, raw) for (request, position), raw in zip(chunk, raws))
        return scored

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        suppressed = [
            (row, sorted(r.stop_ids)) for row, r in enumerate(requests) if r.stop_ids and r.stops_suppressed
        ]
        grammars = [(row, r.grammar) for row, r in enumerate(requests) if r.grammar is not None]
        token_ids = [(r.prompt_token_ids, r.output_token_ids) if r.params.has_penalties else ([], []) for r in requests]
        return SamplingBatch.build(
            [r.params for r in requests], [r.generator for r in requests], suppressed, grammars, token_ids, self.device
        )

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
