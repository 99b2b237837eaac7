"""Decode steps with few requests running: unquantized against int8 weights, and each with
its weights on huge pages and not (contbatch/layers/huge_pages.py), every configuration
loaded once and the runs alternated in one process, so a shared machine's drift falls on all
of them alike.

    python benchmarks/decode_steps.py                      # bf16 and int8, 1/4/8 running
    python benchmarks/decode_steps.py --dtype float32 --running 1,8 --rounds 6

Each round of a configuration is one ``generate`` of ``--tokens`` greedy tokens a request (EOS
ignored, prefix caching off). Two figures a round: the decode step, the median ``step_s`` the
engine reports (contbatch/engine/stats.py) over the round's steps in which every request
running decoded one token, which is what issue 19's decode target is about (int8 <= 0.6x the
unquantized step at <= 8 running); and the whole call divided by the tokens, which adds the
prompts' prefill and the call's own work. The best round of each configuration is reported,
with the int8/unquantized ratios.
"""

import argparse
import os
import statistics
import time

import torch

from _machine import cpu_description
from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir

PROMPT = "Write a long story about a cat and a dog who travel the world together."


class DecodeSteps:
    """The step times (s) of an engine's steps in which every running request decoded one token."""

    def __init__(self, llm: LLM) -> None:
        self.seconds: list[float] = []
        llm.engine.add_stats_listener(self._record)

    def _record(self, stats) -> None:
        if stats.num_scheduled_tokens == stats.num_running == stats.num_sampled:
            self.seconds.append(stats.step_s)


def load(model: str, dtype: str, quantization: str | None, huge_pages: bool) -> tuple[LLM, DecodeSteps]:
    os.environ["CONTBATCH_HUGE_PAGES"] = "1" if huge_pages else "0"  # read as the model loads
    llm = LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
    return llm, DecodeSteps(llm)


def round_ms(llm: LLM, steps: DecodeSteps, running: int, tokens: int) -> tuple[float, float]:
    """(median decode step, whole call / tokens) in ms."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    steps.seconds.clear()
    start = time.perf_counter()
    llm.generate([PROMPT + " " * i for i in range(running)], params, use_tqdm=False)
    whole = (time.perf_counter() - start) / tokens * 1e3
    return statistics.median(steps.seconds) * 1e3, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--running", default="1,4,8", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-huge-pages-compare", action="store_true", help="weights on huge pages only")
    args = parser.parse_args()
    pages = (True,) if args.no_huge_pages_compare else (True, False)
    model = args.model or str(demo_model_dir())
    configs = {(q, huge): load(model, args.dtype, q, huge) for q in (None, "int8") for huge in pages}
    print(f"# {cpu_description()}, {torch.get_num_threads()} threads, {args.dtype}, {args.tokens} tokens, "
          f"best of {args.rounds} alternated rounds, ms a step")
    names = [_name(c) for c in configs]
    print("| running | " + " | ".join(f"{n}: decode step" for n in names) + " | int8 / unquantized, decode step | "
          + " | ".join(f"{n}: call / tokens" for n in names) + " | int8 / unquantized, call / tokens |")
    print("| ---: |" + " ---: |" * (2 * len(configs) + 2))
    for running in (int(n) for n in args.running.split(",")):
        rounds = {c: [] for c in configs}
        for _ in range(args.rounds):
            for config, (llm, steps) in configs.items():
                rounds[config].append(round_ms(llm, steps, running, args.tokens))
        columns = []
        for figure in (0, 1):  # decode step, whole call / tokens
            best = {c: min(r[figure] for r in times) for c, times in rounds.items()}
            ratios = ", ".join(f"{best[('int8', h)] / best[(None, h)]:.2f}x ({_pages(h)})" for h in pages)
            columns += [f"{best[c]:.2f}" for c in configs] + [ratios]
        print(f"| {running} | " + " | ".join(columns) + " |")


def _name(config: tuple[str | None, bool]) -> str:
    quantization, huge = config
    return f"{quantization or 'unquantized'}, {_pages(huge)}"


def _pages(huge: bool) -> str:
    return f"weights on {'2 MiB' if huge else '4 KiB'} pages"


if __name__ == "__main__":
    main()
