"""LLMEngine: builds the model, cache, scheduler and runner; advances all requests one step at a time.

One step, in one direction: the scheduler picks the work (plain data), the
structured-output manager masks the sampling sequences' grammars, the runner runs the
model and samples, the scheduler appends the tokens, the output processor decides
which requests end, and the scheduler ends them.
"""

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from contbatch.config import EngineConfig
from contbatch.engine.bad_words import BadWordsIds, bad_words_token_ids
from contbatch.engine.block_manager import BlockManager
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.engine.model_runner import ModelRunner
from contbatch.engine.output_processor import OutputProcessor
from contbatch.engine.scheduler import Scheduler
from contbatch.engine.scheduler_output import SchedulerOutput
from contbatch.engine.stopping import stop_token_ids
from contbatch.engine.stats import EngineStats, StatsListener, StepStats
from contbatch.engine.threads import ThreadController
from contbatch.engine.tokenizer import eos_token_ids, load_tokenizer
from contbatch.lora.registry import LoRARegistry
from contbatch.lora.request import LoRARequest
from contbatch.models.llama import LlamaForCausalLM
from contbatch.models.loader import load_model, read_config
from contbatch.outputs import RequestOutput
from contbatch.sampling_params import SamplingParams
from contbatch.structured_outputs import StructuredOutputManager

BAD_WORDS_CACHE_SIZE = 1024


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
        self.model_config = read_config(model_dir, config.model_impl)
        self.max_model_len = self._max_model_len(config)
        cache_spec = KVCacheSpec.for_model(self.model_config, config.block_size, config.kv_cache_torch_dtype(dtype))
        num_blocks = cache_spec.num_blocks(config.kv_cache_memory, self.max_model_len, config.max_num_seqs, device)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(model_dir)
        # What the weights were quantized with: the block size follows the int8 kernel running
        # at load, so it is read once, here, for everything that reports it.
        self.quantization = config.quantization_spec()
        model = load_model(model_dir, self.model_config, dtype, device, self.max_model_len, self.quantization)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          group_windows=cache_spec.group_windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.max_loras)
        lora = _lora_registry(model, config, device)
        self.runner = ModelRunner(model, cache_spec, num_blocks, self.eos_token_ids, device, config.seed, lora)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.structured)
        self.stats = EngineStats()
        adapt = config.adapt_threads and device.type == "cpu"
        self.threads = ThreadController(torch.get_num_threads()) if adapt else None
        self._listeners: list[StatsListener] = []
        self._bad_words_cache: dict[tuple[str, ...], BadWordsIds] = {}

    def check_params(self, params: SamplingParams) -> None:
        """ValueError/TypeError if ``params`` are invalid or this engine cannot serve them. The one
        place sampling parameters are checked against the engine; every input path calls it
        before any work."""
        params.validate()
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if self.tokenizer is None and (params.stop or params.structured_outputs is not None):
            raise ValueError("stop strings and structured outputs need a tokenizer (skip_tokenizer_init=True was given)")
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        self._check_token_restrictions(params)

    def _check_token_restrictions(self, params: SamplingParams) -> None:
        """Token ids (stop_token_ids, logit_bias, allowed_token_ids), bad_words and
        truncate_prompt_tokens against this model."""
        vocab_size = self.model_config.vocab_size
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted(token_id for token_id in token_ids if token_id >= vocab_size)
            if outside:
                raise ValueError(f"SamplingParams.{name} must be token ids in [0, {vocab_size}), got {outside[:10]}")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True was given)")
            outside = sorted({t for ids in self._bad_words_ids(params) for t in ids if t >= vocab_size})
            if outside:
                raise ValueError(f"SamplingParams.bad_words: the tokenizer gives ids {outside[:10]} the model's "
                                 f"{vocab_size} logits do not have")
        if params.allowed_token_ids is not None:
            self._check_some_token_allowed(params)
        most = self.max_model_len - 1
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > most:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens must be None, -1 or in [1, {most}] "
                             f"(max_model_len - 1), got {params.truncate_prompt_tokens}")

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids that one-token bad words, or stop ids until min_tokens, leave empty
        would have no token to sample."""
        left = set(params.allowed_token_ids) - {ids[0] for ids in self._bad_words_ids(params) if len(ids) == 1}
        if not left:
            raise ValueError("SamplingParams.allowed_token_ids: every allowed token is one of bad_words")
        if params.min_tokens > 0 and left <= stop_token_ids(params, self.eos_token_ids):
            raise ValueError(f"SamplingParams.allowed_token_ids: every allowed token ends the request, which "
                             f"min_tokens={params.min_tokens} forbids before then")

    def _bad_words_ids(self, params: SamplingParams) -> BadWordsIds:
        """The request's bad words as token sequences, tokenized once per distinct list of words."""
        if not params.bad_words:
            return ()
        words = tuple(params.bad_words)
        ids = self._bad_words_cache.get(words)
        if ids is None:
            ids = bad_words_token_ids(self.tokenizer, words)
            if len(self._bad_words_cache) < BAD_WORDS_CACHE_SIZE:  # a job with a list per record stays bounded
                self._bad_words_cache[words] = ids
        return ids

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Make an adapter ready for requests (read once per ``lora_int_id``); ValueError if this
        engine has no LoRA (enable_lora=False) or cannot serve the adapter."""
        if self.runner.lora is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        self.runner.lora.load(lora_request)

    def loaded_loras(self) -> list[LoRARequest]:
        """The adapters read so far, one per ``lora_int_id`` (none without enable_lora)."""
        return [] if self.runner.lora is None else list(self.runner.lora.loaded.values())

    def add_request(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_logprobs_from: int = 1,
        lora_request: LoRARequest | None = None,
        keep_blocks: bool = False,
        parent_seq_id: int | None = None,
    ) -> int:
        """Queue a request; returns its seq_id. With prompt logprobs, ``prompt_logprobs_from`` is
        the first prompt position scored (earlier entries are None) and the prefix before it may
        be reused from the prefix cache (scoring continuations of one shared context).
        ``lora_request``: the adapter it runs with (loaded here if it is new). ``keep_blocks``
        and ``parent_seq_id``: a request kept once finished, and one continuing from it
        (Scheduler.add_request; ``release`` frees a kept one)."""
        if lora_request is not None:
            self.load_lora(lora_request)
        request = self.scheduler.add_request(
            request_id, prompt, prompt_token_ids, params, prompt_logprobs_from, self._bad_words_ids(params),
            lora_request, keep_blocks, parent_seq_id,
        )
        try:
            if params.structured_outputs is not None:
                self.structured.add(request.seq_id, params.structured_outputs)
            self.outputs.start(request)
        except BaseException:
            self.scheduler.abort(request.seq_id)
            self.structured.remove(request.seq_id)
            raise
        return request.seq_id

    def release(self, seq_ids: Iterable[int]) -> None:
        """Free the blocks of finished requests added with keep_blocks."""
        self.scheduler.release(seq_ids)

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call ``listener(StepStats)`` after every step (see contbatch/engine/stats.py)."""
        self._listeners.append(listener)

    def remove_stats_listener(self, listener: StatsListener) -> None:
        self._listeners.remove(listener)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (the engine is then idle)."""
        self.scheduler.abort_all()
        self.structured.clear()
        if self.threads is not None:
            self.threads.reset()
        self.outputs.abort_all()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def step(self) -> list[RequestOutput]:
        """One model step; returns the outputs of requests that finished in it."""
        start = time.perf_counter()
        if self.threads is not None:
            self.threads.on_step()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            raise RuntimeError("scheduler made no progress: the KV cache cannot hold the next request")
        for new in scheduled.new_seqs:
            if new.sample_index and new.params.structured_outputs is not None:
                self.structured.add(new.seq_id, new.params.structured_outputs)  # a forked sample's own matcher
        masks = self.structured.masks([s.seq_id for s in scheduled.scheduled if s.samples])
        num_blocks_used = self.block_manager.num_used_blocks
        result = self.runner.execute(scheduled, masks)
        self.outputs.record_prompt_logprobs(result.prompt_logprobs)
        finishes = {}
        for request in self.scheduler.update(scheduled, result.sampled):
            finish = self.outputs.process_token(request, result.logprobs.get(request.seq_id))
            if finish is not None:
                finishes[request.seq_id] = finish
        for seq_id in result.without_tokens:
            finishes[seq_id] = self.outputs.end_without_token(self.scheduler.requests[seq_id])
        for seq_id in finishes:
            self.structured.remove(seq_id)
        outputs = self.outputs.collect(self.scheduler.finish(finishes))
        self._record(scheduled, len(result.sampled), num_blocks_used, result.model_s, time.perf_counter() - start)
        return outputs

    def _record(self, scheduled: SchedulerOutput, num_sampled: int, blocks_used: int, model_s: float, step_s: float) -> None:
        stats = StepStats(
            num_running=len(scheduled.scheduled),
            num_waiting=self.scheduler.num_waiting,
            num_scheduled_tokens=scheduled.num_batched_tokens,
            num_sampled=num_sampled,
            query_spans=tuple((s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens) for s in scheduled.scheduled),
            num_blocks_used=blocks_used,
            num_blocks_total=self.block_manager.num_blocks,
            num_preemptions=scheduled.num_preempted,
            num_copied_blocks=len(scheduled.blocks_to_copy),
            num_prefix_queried_tokens=scheduled.num_prefix_queried_tokens,
            num_prefix_hit_tokens=scheduled.num_prefix_hit_tokens,
            model_s=model_s,
            step_s=step_s,
        )
        self.stats.add(stats)
        for listener in self._listeners:
            listener(stats)

    def _max_model_len(self, config: EngineConfig) -> int:
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={model_max}"
            )
        return config.max_model_len or model_max


def _lora_registry(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> LoRARegistry | None:
    """With enable_lora, the registry the runner applies adapters from; ValueError for a model
    on transformers' modeling code, whose layers are not contbatch's."""
    if not config.enable_lora:
        return None
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"enable_lora=True needs one of contbatch's native models; {type(model).__name__} runs on "
                         "transformers' modeling code (model_impl='transformers'), which has no LoRA here")
    return LoRARegistry(model, config.max_lora_rank, device)
