"""Decode step time on a shared machine: contbatch with another process keeping one core busy.

Each configuration runs in its own subprocess (OpenMP settings are read when torch loads):
8 requests decoding 64 tokens each on the demo model, the fastest of 3 runs, reported as
milliseconds per step. The competing load is one Python busy loop, started by this script
and stopped when it ends (at most --max-seconds). Configurations, idle and busy: the default
(all cores, spinning OpenMP waits, threads adapted to the free cores), then with
adapt_threads=False: all cores and 1 thread spinning, all cores with OMP_WAIT_POLICY=PASSIVE.

    python benchmarks/busy_core.py [--update-docs]
"""

import argparse
import os
import subprocess
import sys
import time

from _machine import cpu_description, cpu_kind
from _report import replace_marked

STEP_CODE = """
import sys, time, torch
from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir
torch.set_num_threads(int(sys.argv[1]))
llm = LLM(demo_model_dir(), max_model_len=512, adapt_threads=sys.argv[2] == "adapt")
prompts = [[100 + i, 200 + i, 300 + i] for i in range(8)]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
steps = []
llm.engine.add_stats_listener(lambda stats: steps.append(stats.step_s))
best, best_tail = float("inf"), None
for _ in range(3):
    steps.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if elapsed < best:
        best, best_tail = elapsed, sorted(steps[len(steps) // 2 :])[len(steps) // 4]
print(best / 64 * 1e3, best_tail * 1e3)
"""


def step_ms(threads: int, passive: bool, adapt: bool) -> tuple[float, float]:
    """(mean ms a step over the fastest run, median ms of that run's second half)"""
    env = dict(os.environ)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", STEP_CODE, str(threads), "adapt" if adapt else "fixed"], env=env, capture_output=True, text=True,
                         check=True)
    mean, tail = out.stdout.strip().splitlines()[-1].split()
    return float(mean), float(tail)


def busy_loop(seconds: float) -> subprocess.Popen:
    """One process spinning on a core for at most ``seconds``."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seconds", type=float, default=600, help="the competing load stops by then at the latest")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the busy-core table of docs/performance.md")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    configs = [(cores, False, True), (cores, False, False), (1, False, False), (cores, True, False)]
    rows = []
    for busy in (False, True):
        load = busy_loop(args.max_seconds) if busy else None
        try:
            for threads, passive, adapt in configs:
                ms, tail_ms = step_ms(threads, passive, adapt)
                rows.append((busy, threads, passive, adapt, ms, tail_ms))
                print(f"busy={busy} threads={threads} passive={passive} adapt={adapt}: {ms:.1f} ms a step", flush=True)
        finally:
            if load is not None:
                load.kill()
    table = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `python benchmarks/busy_core.py`: 8 requests decoding, "
        f"SmolLM2-135M in the default dtype; CPU: {cpu_description()}, {cores} cores. Fastest of 3 runs of 64 steps: "
        "the mean step, and the median step of its last 32 (after the thread count has settled).",
        "",
        "| other process | torch threads | adapt_threads | OpenMP wait | ms a decode step | median ms, second half |",
        "| --- | ---: | --- | --- | ---: | ---: |",
        *(f"| {'one busy loop' if busy else 'none'} | {threads} | {'yes (default)' if adapt else 'no'} | "
          f"{'passive' if passive else 'default (spin)'} | {ms:.1f} | {tail_ms:.1f} |"
          for busy, threads, passive, adapt, ms, tail_ms in rows),
    ])
    print(table)
    if args.update_docs:
        replace_marked(f"busy-core-{cpu_kind()}", table)


if __name__ == "__main__":
    main()
