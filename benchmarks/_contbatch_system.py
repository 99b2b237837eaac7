"""contbatch under the benchmark, with per-step statistics from the engine's stats interface.

StepRecorder listens to the engine's StepStats (contbatch/engine/stats.py) and keeps,
per step: running batch size, tokens, sampled tokens, attention context, KV blocks in
use, step time and model time (forward and logits).
"""

import time
from typing import NamedTuple

from contbatch import LLM, SamplingParams

from _results import peak_rss_mib, summarize
from _roofline import ModelFlops, context_sum
from _workloads import random_requests


class StepSample(NamedTuple):
    batch: int  # requests scheduled (running) in the step
    tokens: int
    sampled: int  # tokens sampled, i.e. requests that reached the end of their tokens
    context_sum: int  # keys attended to, summed over the step's tokens
    kv_blocks_used: int
    step_s: float
    model_s: float  # forward + compute_logits


class StepRecorder:
    """Samples every step of ``engine`` through its stats interface, from the moment it is created."""

    def __init__(self, engine) -> None:
        self.samples: list[StepSample] = []
        engine.add_stats_listener(self._record)

    def clear(self) -> None:
        self.samples.clear()

    def _record(self, stats) -> None:
        self.samples.append(
            StepSample(
                batch=stats.num_running,
                tokens=stats.num_scheduled_tokens,
                sampled=stats.num_sampled,
                context_sum=sum(context_sum(first, end) for first, end in stats.query_spans),
                kv_blocks_used=stats.num_blocks_used,
                step_s=stats.step_s,
                model_s=stats.model_s,
            )
        )


def _generate(llm: LLM, requests: list) -> list:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    return llm.generate(prompts, params, use_tqdm=False)


def _counters(llm: LLM) -> dict:
    stats = llm.engine.stats
    return {
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "cache_queries": stats.num_prefix_queried_tokens,
        "cache_hits": stats.num_prefix_hit_tokens,
    }


def run_contbatch(model_dir, dtype: str, requests: list, warmup: list, tokenizer, settings: dict) -> dict:
    """Time llm.generate over the workload; then, if settings["decode_batch"], the decode probe."""
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=dtype,
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        seed=0,
        model_impl=settings["model_impl"],
        quantization=settings.get("quantization"),
        kv_cache_dtype=settings.get("kv_cache_dtype", "auto"),
    )
    load_s = time.perf_counter() - start
    _generate(llm, warmup)
    recorder = StepRecorder(llm.engine)
    before = _counters(llm)
    start_wall, start = time.time(), time.perf_counter()
    outputs = _generate(llm, requests)
    wall = time.perf_counter() - start
    rss = peak_rss_mib()
    after = {key: value - before[key] for key, value in _counters(llm).items()}
    ttfts = [out.metrics.first_token_time - start_wall for out in outputs]
    generated = [len(out.outputs[0].token_ids) for out in outputs]
    result = summarize(requests, wall, ttfts, generated, load_s, rss)
    result["config"] = dict(settings)
    result["cached_prompt_tokens"] = sum(out.num_cached_tokens for out in outputs)
    result["token_ids"] = [list(out.outputs[0].token_ids) for out in outputs]  # for greedy agreement, then dropped
    result.update(_step_statistics(recorder.samples, llm, after, wall))
    if settings["decode_batch"]:
        recorder.clear()
        result["decode_probe"] = _decode_probe(llm, tokenizer, recorder, settings["decode_batch"], model_dir)
    return result


def _step_statistics(samples: list[StepSample], llm: LLM, counters: dict, wall: float) -> dict:
    step_time = sum(s.step_s for s in samples)
    model_time = sum(s.model_s for s in samples)
    return {
        "steps": counters["steps"],
        "steps_per_s": counters["steps"] / wall,
        "mean_running_batch": sum(s.batch for s in samples) / max(len(samples), 1),
        "step_time_share_outside_model": 1 - model_time / step_time if step_time else None,
        "kv_blocks_used_peak": max((s.kv_blocks_used for s in samples), default=0),
        "kv_blocks_total": llm.engine.block_manager.num_blocks,
        "block_size": llm.engine.config.block_size,
        "preemptions": counters["preemptions"],
        "prefix_cache_hit_rate": counters["cache_hits"] / counters["cache_queries"] if counters["cache_queries"] else 0.0,
        "step_fields": list(StepSample._fields),
        "step_samples": list(samples),
    }


def _decode_probe(llm: LLM, tokenizer, recorder: StepRecorder, batch: int, model_dir) -> dict:
    """Decode-only rate with ``batch`` sequences running: the steps where every sequence decodes one token."""
    if batch > llm.engine.config.max_num_seqs:
        raise ValueError(f"decode_batch={batch} exceeds max_num_seqs={llm.engine.config.max_num_seqs}")
    _generate(llm, random_requests(tokenizer, count=batch, prompt_len=32, max_tokens=32, seed=1))
    steps = [s for s in recorder.samples if s.batch == batch and s.tokens == batch]
    flops = ModelFlops.from_config(model_dir)
    step_s = sum(s.step_s for s in steps)
    model_s = sum(s.model_s for s in steps)
    total = sum(flops.step_flops(s.tokens, s.sampled, s.context_sum) for s in steps)
    return {
        "batch": batch,
        "prompt_len": 32,
        "decode_steps": len(steps),
        "output_tok_s": batch * len(steps) / step_s if step_s else None,
        "gflops": total / step_s / 1e9 if step_s else None,
        "model_gflops": total / model_s / 1e9 if model_s else None,
    }
