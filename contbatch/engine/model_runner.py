"""ModelRunner: owns the model and the KV cache tensors; turns a step into tokens.

A step's requests are flattened into one varlen batch with no padding: their new
tokens are concatenated into ``input_ids``/``positions``, each token gets its cache
slot, and each sequence its block table and context length. Logits are computed
only for the last token of requests that reach the end of their tokens.
"""

from dataclasses import dataclass

import numpy as np
import torch

from contbatch import ops
from contbatch.engine.scheduler import SchedulerOutput
from contbatch.layers.attention import AttentionMetadata
from contbatch.layers.sampler import SamplingBatch, sample
from contbatch.models.config import ModelConfig


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_rows] int64, rows of the flattened batch to sample from
    sampling_request_ids: list[int]


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
    def execute(self, step: SchedulerOutput) -> dict[int, int]:
        """Run one step; return the sampled token of every request that produced one, by request id."""
        if step.blocks_to_copy:
            mapping = torch.tensor(step.blocks_to_copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)
        model_input = self.prepare_input(step)
        hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata)
        if not model_input.sampling_request_ids:
            return {}
        logits = self.model.compute_logits(hidden[model_input.logits_indices]).float()
        tokens = sample(logits, self._sampling_batch(step), self.generator).tolist()
        return dict(zip(model_input.sampling_request_ids, tokens))

    def prepare_input(self, step: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        seq_lens, query_lens, logits_rows, sampling_ids = [], [], [], []
        max_blocks = 0
        for item in step.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(request.token_ids[start:end])
            token_positions = np.arange(start, end)
            positions.append(token_positions)
            blocks = np.asarray(request.block_ids, dtype=np.int64)
            slots.append(blocks[token_positions // self.block_size] * self.block_size + token_positions % self.block_size)
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            max_blocks = max(max_blocks, len(request.block_ids))
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
                sampling_ids.append(request.request_id)
        block_tables = np.zeros((len(step.scheduled), max_blocks), dtype=np.int32)
        for row, item in enumerate(step.scheduled):
            block_tables[row, : len(item.request.block_ids)] = item.request.block_ids
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots), torch.int64),
            block_tables=self._tensor(block_tables, torch.int32),
            seq_lens=self._tensor(np.asarray(seq_lens, dtype=np.int32), torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
        )
        return ModelInput(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64), torch.int64),
            positions=self._tensor(np.concatenate(positions), torch.int64),
            metadata=metadata,
            logits_indices=self._tensor(np.asarray(logits_rows, dtype=np.int64), torch.int64),
            sampling_request_ids=sampling_ids,
        )

    def _sampling_batch(self, step: SchedulerOutput) -> SamplingBatch:
        requests = [item.request for item in step.scheduled if item.samples]
        suppressed = [
            (row, sorted(r.stop_ids))
            for row, r in enumerate(requests)
            if r.stop_ids and r.num_output_tokens < r.params.min_tokens
        ]
        return SamplingBatch.build(
            [r.params for r in requests], [r.generator for r in requests], suppressed, self.device
        )

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
