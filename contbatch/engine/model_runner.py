"""ModelRunner: owns the model, the KV cache tensor and its batch state; turns a step into tokens.

Each step it applies the scheduler's plain-data output to its ``InputBatch``, runs the
model over the flat varlen batch, and samples. Logits are computed only for the last
token of sequences that reach the end of their tokens (plus every prompt position of
sequences that asked for prompt logprobs). It reports what it sampled by seq_id.
"""

import time
from dataclasses import dataclass, field

import torch

from contbatch import ops
from contbatch.engine.input_batch import InputBatch, SeqState
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.engine.scheduler_output import SchedulerOutput
from contbatch.layers.logprobs import RawLogprobs, compute_logprobs
from contbatch.layers.sampler import SamplerScratch, TokenMasks, sample
from contbatch.lora.registry import LoRARegistry

PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class RunnerOutput:
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> token id
    logprobs: dict[int, RawLogprobs] = field(default_factory=dict)  # seq_id -> its token's logprobs
    prompt_logprobs: list[tuple[int, int, RawLogprobs]] = field(default_factory=list)  # (seq_id, position, ...)
    without_tokens: list[int] = field(default_factory=list)  # seq_ids whose masks left no token to sample
    model_s: float = 0.0  # time in the model's forward and logits


def copy_waves(copies: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Ordered (source, destination) copies as calls of copy_blocks, which runs a call's copies
    in parallel: a copy that would write a block the current call reads or writes, or read
    one it writes, starts the next call. Almost every step needs one call at most."""
    waves: list[list[tuple[int, int]]] = []
    read: set[int] = set()
    written: set[int] = set()
    for source, destination in copies:
        if not waves or destination in read or destination in written or source in written:
            waves.append([])
            read, written = set(), set()
        waves[-1].append((source, destination))
        read.add(source)
        written.add(destination)
    return waves


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache_spec: KVCacheSpec,
        num_blocks: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
        seed: int,
        lora: LoRARegistry | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # the LoRA adapters loaded into the model, with enable_lora
        self.device = device
        self.kv_cache, self.kv_caches = cache_spec.allocate(num_blocks, device)
        self.layer_groups = cache_spec.layer_groups
        self.batch = InputBatch(cache_spec.block_size, len(cache_spec.groups), eos_token_ids, device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.sampler_scratch = SamplerScratch()

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, masks: TokenMasks | None = None) -> RunnerOutput:
        """Run one step: the sampled token of every sequence that produced one, and requested logprobs."""
        self.batch.update(step)
        for wave in copy_waves(step.blocks_to_copy):
            mapping = torch.tensor(wave, dtype=torch.int64, device=self.device)
            ops.copy_blocks(list(self.kv_cache[:, 0]), list(self.kv_cache[:, 1]), mapping)  # a block's every layer
        model_input = self.batch.prepare(step)
        metadata = [model_input.metadata[group] for group in self.layer_groups]
        if self.lora is not None:
            self.lora.set_step(model_input.row_adapters)
        result = RunnerOutput()
        start = time.perf_counter()
        hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches, metadata)
        if model_input.prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(hidden, model_input.prompt_rows, model_input.prompt_targets)
        seqs = model_input.sampling_seqs
        sample_logits = self._logits(hidden, model_input.sample_rows) if seqs else None
        result.model_s = time.perf_counter() - start
        if not seqs:
            return result
        wants_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logits = sample_logits[wants_logprobs].float() if wants_logprobs else None  # a copy
        tokens, rows_without_tokens = sample(
            sample_logits, self.batch.sampling_batch(seqs, masks), self.generator, self.sampler_scratch
        )
        if raw_logits is not None:
            chosen = tokens[wants_logprobs]
            ks = [seqs[i].params.logprobs for i in wants_logprobs]
            for i, raw in zip(wants_logprobs, compute_logprobs(raw_logits, chosen, ks)):
                result.logprobs[seqs[i].seq_id] = raw
        token_list = tokens.tolist()
        if rows_without_tokens:  # those sequences get no token; the engine ends them
            result.without_tokens = [seqs[row].seq_id for row in rows_without_tokens]
            kept = sorted(set(range(len(seqs))) - set(rows_without_tokens))
            seqs, token_list = [seqs[row] for row in kept], [token_list[row] for row in kept]
        self.batch.append_sampled(seqs, token_list)
        result.sampled = {s.seq_id: token for s, token in zip(seqs, token_list)}
        return result

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of the given rows in the model's dtype (the sampler makes fp32 copies as needed)."""
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[int], targets: list[tuple[SeqState, int]]
    ) -> list[tuple[int, int, RawLogprobs]]:
        """Scored in chunks: a full-vocabulary fp32 row is ~200 KB for a 50k vocabulary."""
        scored = []
        for begin in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            chunk = targets[begin : begin + PROMPT_LOGPROBS_CHUNK]
            logits = self._logits(hidden, rows[begin : begin + PROMPT_LOGPROBS_CHUNK])
            token_ids = torch.tensor([s.token_ids[p] for s, p in chunk], device=self.device)
            raws = compute_logprobs(logits.float(), token_ids, [s.params.prompt_logprobs for s, _ in chunk])
            scored.extend((seq.seq_id, position, raw) for (seq, position), raw in zip(chunk, raws))
        return scored
