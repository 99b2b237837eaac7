"""Decode steps with few requests running: unquantized against int8 weights, and each with
and without huge pages, every configuration loaded once and the runs alternated in one
process, so a shared machine's drift falls on all of them alike.

    python benchmarks/decode_steps.py                      # bf16 and int8, 1/4/8 running
    python benchmarks/decode_steps.py --dtype float32 --running 1,8 --rounds 6

A step's time is a whole ``generate`` of ``--tokens`` greedy tokens (EOS ignored, prefix
caching off) divided by the tokens; the best round of each configuration is reported, with
the int8/unquantized ratio that issue 19's decode target is about (<= 0.6x at <= 8 running).
"""

import argparse
import os
import time

import torch

from _machine import cpu_description
from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir

PROMPT = "Write a long story about a cat and a dog who travel the world together."


def load(model: str, dtype: str, quantization: str | None, huge_pages: bool) -> LLM:
    os.environ["CONTBATCH_HUGE_PAGES"] = "1" if huge_pages else "0"  # read as the model loads
    return LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False)


def step_ms(llm: LLM, running: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT + " " * i for i in range(running)], params, use_tqdm=False)
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--running", default="1,4,8", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-huge-pages-compare", action="store_true", help="huge pages on only")
    args = parser.parse_args()
    pages = (True,) if args.no_huge_pages_compare else (True, False)
    model = args.model or str(demo_model_dir())
    configs = {(q, huge): load(model, args.dtype, q, huge) for q in (None, "int8") for huge in pages}
    print(f"# {cpu_description()}, {torch.get_num_threads()} threads, {args.dtype}, {args.tokens} tokens, "
          f"best of {args.rounds} alternated rounds, ms a step")
    print("| running | " + " | ".join(_name(c) for c in configs) + " | int8 / unquantized |")
    print("| ---: |" + " ---: |" * (len(configs) + 1))
    for running in (int(n) for n in args.running.split(",")):
        times = {c: [] for c in configs}
        for _ in range(args.rounds):
            for config, llm in configs.items():
                times[config].append(step_ms(llm, running, args.tokens))
        best = {c: min(t) for c, t in times.items()}
        ratios = ", ".join(f"{best[('int8', h)] / best[(None, h)]:.2f}x ({_pages(h)} pages)" for h in pages)
        print(f"| {running} | " + " | ".join(f"{best[c]:.2f}" for c in configs) + f" | {ratios} |")


def _name(config: tuple[str | None, bool]) -> str:
    quantization, huge = config
    return f"{quantization or 'unquantized'}, {_pages(huge)} pages"


def _pages(huge: bool) -> str:
    return "2 MiB" if huge else "4 KiB"


if __name__ == "__main__":
    main()
