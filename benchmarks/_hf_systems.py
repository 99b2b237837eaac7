"""The HF transformers baselines: static batches, its own continuous batching, one request at a time.

TTFT is measured from the start of the timed run (every request is submitted at
once, as in an offline batch job), except for hf_serial, whose TTFT is each
request's own (see run_hf_serial).
"""

import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

from _results import peak_rss_mib, summarize

HF_CB_DEFAULTS = {
    "attn": "paged|eager",
    "page_size": 16,
    "num_blocks": 2048,
    "max_batch_tokens": 512,
    "max_requests_per_batch": 32,
    "scheduler_type": "fifo",
}
"""Best HF continuous-batching config found on CPU (see benchmarks/README.md for the sweep)."""


def load_hf_model(model_dir, dtype: torch.dtype, attn: str = "sdpa") -> tuple[torch.nn.Module, float]:
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).eval()
    return model, time.perf_counter() - start


class _FirstTokenTimer(BaseStreamer):
    """Records when generate() hands out its first generated tokens (the prompt, if streamed, is skipped)."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        is_prompt = value.dim() == 2 and value.shape[-1] == self.prompt_len
        if self.first_token_time is None and not is_prompt:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def left_padded(batch: list, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompts as generate() takes them: input ids padded on the left, and their attention mask."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, request in enumerate(batch):
        n = len(request.prompt_token_ids)
        input_ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - n :] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def _generate(model, batch: list, pad_token_id: int) -> tuple[int, float]:
    """Greedy generate() over left-padded prompts, each run to the batch's largest max_tokens.

    Returns the number of tokens generated per row and the first token's time.
    """
    input_ids, attention_mask = left_padded(batch, pad_token_id)
    width = input_ids.shape[1]
    max_tokens = max(r.max_tokens for r in batch)
    timer = _FirstTokenTimer(width)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_token_id
    )
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, streamer=timer)
    return out.shape[1] - width, timer.first_token_time


def run_hf_static(model_dir, dtype: torch.dtype, requests: list, warmup: list, batch_size: int) -> dict:
    """Static batching: batches of ``batch_size`` in workload order, each run to its longest request."""
    model, load_s = load_hf_model(model_dir, dtype)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate(model, warmup, pad)
    start = time.perf_counter()
    ttfts, generated = [], []
    for index in range(0, len(requests), batch_size):
        batch = requests[index : index + batch_size]
        num_generated, first_token_time = _generate(model, batch, pad)
        ttfts += [first_token_time - start] * len(batch)
        generated += [min(num_generated, r.max_tokens) for r in batch]
    wall = time.perf_counter() - start
    result = summarize(requests, wall, ttfts, generated, load_s, peak_rss_mib())
    result["config"] = {"batch_size": batch_size, "attn": "sdpa"}
    return result


def run_hf_serial(model_dir, dtype: torch.dtype, requests: list, warmup: list) -> dict:
    """One request at a time with generate(); TTFT is from the request's own start, not the run's."""
    model, load_s = load_hf_model(model_dir, dtype)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate(model, warmup[:1], pad)
    ttfts, generated = [], []
    start = time.perf_counter()
    for request in requests:
        request_start = time.perf_counter()
        num_generated, first_token_time = _generate(model, [request], pad)
        ttfts.append(first_token_time - request_start)
        generated.append(min(num_generated, request.max_tokens))
    wall = time.perf_counter() - start
    return summarize(requests, wall, ttfts, generated, load_s, peak_rss_mib())


def run_hf_cb(model_dir, dtype: torch.dtype, requests: list, warmup: list, settings: dict) -> dict:
    """transformers' own continuous batching (init_continuous_batching + add_request), eager, no compile."""
    unknown = set(settings) - set(HF_CB_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown hf_cb settings {sorted(unknown)}; allowed: {', '.join(HF_CB_DEFAULTS)}")
    settings = {**HF_CB_DEFAULTS, **settings}
    model, load_s = load_hf_model(model_dir, dtype, settings["attn"])
    cb_config = ContinuousBatchingConfig(
        page_size=settings["page_size"],
        num_blocks=settings["num_blocks"],
        max_batch_tokens=settings["max_batch_tokens"],
        max_requests_per_batch=settings["max_requests_per_batch"],
        scheduler_type=settings["scheduler_type"],
    )
    # eos_token_id=-1: no EOS, so every request runs to its max_new_tokens (ignore_eos).
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        _cb_generate(manager, warmup, "warmup")
        start = time.perf_counter()
        outputs = _cb_generate(manager, requests, "req")
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    ttfts = [out.timestamps[0] - start for out in outputs]
    generated = [min(len(out.generated_tokens), r.max_tokens) for out, r in zip(outputs, requests)]
    result = summarize(requests, wall, ttfts, generated, load_s, peak_rss_mib())
    result["config"] = settings
    return result


def _cb_generate(manager, requests: list, prefix: str) -> list:
    """Submit all requests, wait for all; results in request order."""
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    for request_id, request in zip(ids, requests):
        manager.add_request(
            request.prompt_token_ids,
            request_id=request_id,
            max_new_tokens=request.max_tokens,
            record_timestamps=True,
            eos_token_id=-1,
        )
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("HF continuous batching thread stopped before finishing every request")
    return [results[i] for i in ids]
