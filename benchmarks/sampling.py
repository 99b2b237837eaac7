"""Sampled decoding against greedy: what temperature, a seed and top-p cost on top of the model.

    python benchmarks/sampling.py                       # 256 prompts x 64 tokens, bf16, 2 rounds
    python benchmarks/sampling.py --prompts 64 --tokens 128 --dtype float32 --rounds 3

Every configuration generates the same prompts (``ignore_eos``, so each makes the same number
of tokens) in one loaded LLM, the configurations alternated in each round so that a shared
machine's drift falls on all of them alike; the best round of each is reported with its ratio
to greedy. With 256 rows a step samples 256 rows of the whole vocabulary (49,152 tokens for
the demo model): the sampler's passes over them are what separates the columns.
"""

import argparse
import time

import torch

from _machine import cpu_description
from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "temperature 0.8, seeded": dict(temperature=0.8, seed=1),
    "temperature 0.8, top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "temperature 0.7, top_k 40, top_p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
}


def run_s(llm: LLM, prompts: list[str], tokens: int, settings: dict) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **settings)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model or str(demo_model_dir()), dtype=args.dtype)
    prompts = [f"Write a short story about the number {i}." for i in range(args.prompts)]
    run_s(llm, prompts[:8], 4, {})  # warm-up
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, settings in CONFIGS.items():
            times[name].append(run_s(llm, prompts, args.tokens, settings))
    print(f"# {cpu_description()}, {torch.get_num_threads()} threads, {args.dtype}, {args.prompts} prompts x "
          f"{args.tokens} tokens, best of {args.rounds} alternated rounds")
    print("| sampling | s | output tok/s | time / greedy's |")
    print("| --- | ---: | ---: | ---: |")
    greedy = min(times["greedy"])
    for name, measured in times.items():
        best = min(measured)
        print(f"| {name} | {best:.2f} | {args.prompts * args.tokens / best:.0f} | {best / greedy:.2f}x |")


if __name__ == "__main__":
    main()
