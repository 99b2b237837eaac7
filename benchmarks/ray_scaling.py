"""Ray Data on one machine: two actors of half the cores each against one LLM with all of them,
and what starting Ray and its actors costs.

Both runs get the same requests (the workload's prompt token ids, greedy, EOS ignored, each
request to its own max_tokens) and the same engine settings. The one LLM is built and timed
in this process; then a local Ray instance is started and ``contbatch.integrations.ray``
runs the same rows on ``--actors`` actors. Every engine reports its steps (start, end), so
the table shows, besides wall times, how long each engine computed from its first step to its
last and which share of that it spent in steps (the rest: time between steps, e.g. waiting for
rows). Prints a markdown table; --update-docs writes it into docs/scaling.md ("Measured here").

    python benchmarks/ray_scaling.py --dtype bf16 --update-docs
    python benchmarks/ray_scaling.py --limit 8 --max-tokens-cap 4   # a quick check that it runs
"""

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from contbatch import LLM, SamplingParams

from _machine import cpu_description
from _report import markdown_table, replace_marked
from _workloads import REPO_ROOT, WORKLOADS, BenchRequest, load_workload

DOCS_PATH = REPO_ROOT / "docs" / "scaling.md"
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class EngineSpan:
    """One engine's steps: when the first began, when the last ended, and the time in steps."""

    first_start: float
    last_end: float
    in_steps_s: float

    @property
    def busy_share(self) -> float:
        return self.in_steps_s / max(self.last_end - self.first_start, 1e-9)


@dataclass
class RunResult:
    label: str
    startup_s: float  # one LLM: LLM(...) built; Ray: processor called -> first engine step of any actor
    wall_s: float  # one LLM: generate(); Ray: processor called -> every row back
    output_tokens: int
    spans: list[EngineSpan]

    @property
    def engine_s(self) -> float:
        """First step of any engine to the last step of any."""
        return max(s.last_end for s in self.spans) - min(s.first_start for s in self.spans)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: the demo model)")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat256")
    parser.add_argument("--limit", type=int, default=None, help="run the first N requests only")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens")
    parser.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default="bf16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="cores in all: the one LLM's torch threads, split evenly between the actors")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per Ray Data batch")
    parser.add_argument("--max-concurrent-batches", type=int, default=16, help="batches one actor holds at once")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="every engine's max_num_seqs")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="every engine's KV cache")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the 'Measured here' table of docs/scaling.md")
    args = parser.parse_args()
    if args.threads < args.actors:
        parser.error(f"--threads ({args.threads}) must be at least --actors ({args.actors})")
    return args


def step_recorder(directory: Path):
    """on_actor_start hook: the actor writes "<end> <step_s>" per engine step to directory/<pid>.steps."""

    def on_actor_start(llm: LLM) -> None:
        log = open(directory / f"{os.getpid()}.steps", "a", buffering=1)
        llm.engine.add_stats_listener(lambda stats: log.write(f"{time.time()} {stats.step_s}\n"))

    return on_actor_start


def span_of(steps: list[tuple[float, float]]) -> EngineSpan:
    """The span of (end, step_s) samples."""
    return EngineSpan(steps[0][0] - steps[0][1], steps[-1][0], sum(step_s for _, step_s in steps))


def read_span(path: Path) -> EngineSpan:
    return span_of([tuple(map(float, line.split())) for line in path.read_text().splitlines()])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"dtype": DTYPE_NAMES[args.dtype], "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory": int(args.kv_cache_gib * (1 << 30))}


def params_for(request: BenchRequest) -> dict:
    """SamplingParams fields: the same request for both runs (a dict is what a Ray row holds)."""
    return {"temperature": 0, "max_tokens": request.max_tokens, "ignore_eos": True}


def run_one_llm(model: Path, requests: list[BenchRequest], args: argparse.Namespace) -> RunResult:
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(model, **engine_kwargs(args))
    startup = time.perf_counter() - start
    steps: list[tuple[float, float]] = []
    llm.engine.add_stats_listener(lambda stats: steps.append((time.time(), stats.step_s)))
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], [SamplingParams(**params_for(r)) for r in requests], use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return RunResult(f"one LLM, {args.threads} threads", startup, wall, tokens, [span_of(steps)])


def run_ray(model: Path, requests: list[BenchRequest], args: argparse.Namespace) -> tuple[RunResult, float]:
    """The Ray run, and the seconds ray.init took."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from contbatch.integrations.ray import build_processor

    start = time.perf_counter()
    # One logical CPU more than the actors take: Ray Data's own tasks need one (the rows are
    # in memory here, so none runs).
    ray.init(num_cpus=args.threads + 1, include_dashboard=False)
    ray_init_s = time.perf_counter() - start
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = [{"id": i, "prompt_token_ids": r.prompt_token_ids, "sampling_params": params_for(r)}
            for i, r in enumerate(requests)]
    threads = args.threads // args.actors
    with tempfile.TemporaryDirectory() as scratch:
        processor = build_processor(
            model=model, engine_kwargs=engine_kwargs(args), concurrency=args.actors, batch_size=args.batch_size,
            max_concurrent_batches=args.max_concurrent_batches, num_cpus=args.threads / args.actors,
            num_threads=threads, on_actor_start=step_recorder(Path(scratch)),
        )
        num_blocks = -(-len(rows) // args.batch_size)
        called = time.time()
        out = processor(ray.data.from_items(rows, override_num_blocks=num_blocks)).take_all()
        wall = time.time() - called
        spans = [read_span(path) for path in Path(scratch).glob("*.steps") if path.stat().st_size]
    ray.shutdown()
    failed = [row["error"] for row in out if row["error"] is not None]
    if len(out) != len(rows) or failed:
        raise RuntimeError(f"the Ray run returned {len(out)} of {len(rows)} rows, {len(failed)} failed: {failed[:3]}")
    startup = min(s.first_start for s in spans) - called
    tokens = sum(len(row["generated_token_ids"]) for row in out)
    label = f"Ray Data, {args.actors} actors x {threads} threads"
    return RunResult(label, startup, wall, tokens, spans), ray_init_s


def report(one: RunResult, ray_run: RunResult, ray_init_s: float, num_requests: int, args: argparse.Namespace) -> str:
    command = " ".join(["python", "benchmarks/ray_scaling.py", *sys.argv[1:]])
    rows = [
        [run.label, f"{run.startup_s:.1f}", f"{run.wall_s:.1f}", f"{run.output_tokens / run.wall_s:.1f}",
         f"{run.engine_s:.1f}", f"{run.output_tokens / run.engine_s:.1f}",
         ", ".join(f"{s.busy_share:.0%}" for s in run.spans)]
        for run in (one, ray_run)
    ]
    end_to_end = (ray_run.output_tokens / ray_run.wall_s) / (one.output_tokens / one.wall_s)
    steady = (ray_run.output_tokens / ray_run.engine_s) / (one.output_tokens / one.engine_s)
    return "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `{command}`: workload `{args.workload}`, "
        f"{num_requests} requests, {one.output_tokens:,} output tokens, greedy, EOS ignored; "
        f"{args.dtype}; CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f} at the end.",
        "",
        *markdown_table(["Setup", "Start-up (s)", "Wall (s)", "Output tok/s", "Engines computing (s)",
                         "Output tok/s while computing", "Time in steps, per engine"], rows),
        "",
        f"Two actors against one LLM: **{end_to_end:.2f}x** the output tokens/s end to end (from the "
        f"processor's call, actors' start included), **{steady:.2f}x** from the first engine step to the last.",
        f"Ray's start-up: `ray.init` of a local instance {ray_init_s:.1f} s, then {ray_run.startup_s:.1f} s from "
        f"the processor's call to the first engine step (actor processes, imports, model load), against "
        f"{one.startup_s:.1f} s to build the one LLM in a running process.",
    ])


def main() -> None:
    args = parse_args()
    if args.model is None:
        from contbatch.demo_model import demo_model_dir

        args.model = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = load_workload(args.workload, tokenizer, args.limit, args.max_tokens_cap)
    one = run_one_llm(args.model, requests, args)
    print(f"{one.label}: {one.wall_s:.1f} s", flush=True)
    gc.collect()  # the one LLM's KV cache, before the actors take theirs
    ray_run, ray_init_s = run_ray(args.model, requests, args)
    print(f"{ray_run.label}: {ray_run.wall_s:.1f} s", flush=True)
    section = report(one, ray_run, ray_init_s, len(requests), args)
    print(section)
    if args.update_docs:
        replace_marked("ray-scaling", section, DOCS_PATH)
        print(f"updated {DOCS_PATH}")


if __name__ == "__main__":
    main()
