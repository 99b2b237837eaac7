"""LLMEngine: builds the model, cache, scheduler and runner; advances all requests one step at a time."""

import functools
import logging
import os
from pathlib import Path

import torch

from contbatch.config import EngineConfig
from contbatch.engine.block_manager import BlockManager
from contbatch.engine.model_runner import ModelRunner
from contbatch.engine.output_processor import OutputProcessor
from contbatch.engine.request import Request
from contbatch.engine.scheduler import Scheduler
from contbatch.engine.tokenizer import eos_token_ids, load_tokenizer
from contbatch.models.loader import load_model, read_config
from contbatch.outputs import RequestOutput
from contbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_FRACTION = 0.3
"""Share of available RAM given to the KV cache when kv_cache_memory is not set."""


class LLMEngine:
    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        skip_tokenizer_init: bool = False,
    ) -> None:
        self.config = config
        self.model_config = read_config(model_dir)
        self.max_model_len = self._max_model_len(config)
        num_blocks = self._num_kv_blocks(dtype, device)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(model_dir)
        model = load_model(model_dir, self.model_config, dtype, device, self.max_model_len)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(model, self.model_config, num_blocks, config.block_size, device, dtype, config.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        self._compiler = None
        self.num_steps = 0

    def check_params(self, params: SamplingParams) -> None:
        """ValueError/TypeError if ``params`` are invalid or this engine cannot serve them (checked before any work)."""
        params.validate()
        vocab_size = self.model_config.vocab_size
        outside = [token_id for token_id in params.stop_token_ids if token_id >= vocab_size]
        if outside:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids in [0, {vocab_size}), got {outside}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if self.tokenizer is None and (params.stop or params.structured_outputs is not None):
            raise ValueError("stop strings and structured outputs need a tokenizer (skip_tokenizer_init=True was given)")
        if params.structured_outputs is not None:
            self._grammar_compiler().validate(params.structured_outputs)

    def add_request(self, request_id: int, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        request = Request(request_id, prompt, prompt_token_ids, params, self.eos_token_ids)
        if params.structured_outputs is not None:
            request.make_grammar = functools.partial(self._grammar_compiler().matcher, params.structured_outputs)
            request.grammar = request.make_grammar()
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (the engine is then idle)."""
        self.scheduler.abort_all()
        self.outputs.abort_all()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """One model step; returns the outputs of requests that finished in it."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            raise RuntimeError("scheduler made no progress: the KV cache cannot hold the next request")
        result = self.runner.execute(scheduled)
        self.outputs.record_prompt_logprobs(result.prompt_logprobs)
        for request in self.scheduler.update(scheduled, result.sampled):
            self.outputs.process_token(request, result.logprobs.get(request))
        self.num_steps += 1
        return self.outputs.collect(self.scheduler.free_finished())

    def _grammar_compiler(self):
        if self._compiler is None:
            from contbatch.structured_outputs import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._compiler

    def _max_model_len(self, config: EngineConfig) -> int:
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={model_max}"
            )
        return config.max_model_len or model_max

    def _num_kv_blocks(self, dtype: torch.dtype, device: torch.device) -> int:
        config = self.config
        per_block = ModelRunner.bytes_per_block(self.model_config, config.block_size, dtype)
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        useful = per_block * blocks_per_seq * config.max_num_seqs
        memory = config.kv_cache_memory
        if memory is None:
            memory = min(int(_available_memory(device) * DEFAULT_KV_CACHE_FRACTION), useful)
            logger.info("KV cache: %.2f GiB (%d blocks of %d tokens)", memory / 2**30, memory // per_block, config.block_size)
        num_blocks = memory // per_block
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds {num_blocks} blocks of {config.block_size} tokens, "
                f"fewer than one max_model_len={self.max_model_len} sequence needs ({blocks_per_seq}); "
                f"give at least {blocks_per_seq * per_block} bytes or lower max_model_len"
            )
        return num_blocks


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
