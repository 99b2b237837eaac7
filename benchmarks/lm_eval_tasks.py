"""Times the same lm-eval tasks with lm-eval's ``hf`` backend and with ``contbatch``, one run.

Two tasks over generated local data (nothing from a hub): a multiple-choice task
(log-likelihood requests, 4 choices per question) and a greedy generation task
(generate_until with a stop string, a fixed max_gen_toks). Both backends evaluate them on
SmolLM2-135M in the given dtype through ``lm_eval.simple_evaluate``; the wall time covers
the whole evaluation (requests built, run, scored), not model loading. The hf backend runs
at --hf-batch-size (its default is 1; larger is faster on this CPU up to a point).

    python benchmarks/lm_eval_tasks.py [--dtype fp32|bf16] [--questions 400] [--generations 128] [--update-docs]
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import lm_eval
import torch
from lm_eval.tasks import TaskManager

import contbatch.integrations.lm_eval  # noqa: F401  (registers "contbatch")
from contbatch.demo_model import demo_model_dir

from _machine import cpu_description, cpu_kind
from _report import markdown_table, replace_marked

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SUBJECTS = ["cat", "river", "teacher", "mountain", "computer", "garden", "ship", "doctor", "city", "song"]
VERBS = ["likes", "sees", "follows", "builds", "remembers", "finds", "paints", "visits"]
OBJECTS = ["the bridge", "a small house", "the old road", "a red kite", "the market", "a blue door", "the tower", "a letter"]


def write_tasks(directory: Path, questions: int, generations: int, max_gen_toks: int) -> None:
    rng = random.Random(0)
    with open(directory / "mc.jsonl", "w") as out:
        for index in range(questions):  # each question unique, as in real tasks (lm-eval scores a repeated pair once)
            subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
            choices = rng.sample(OBJECTS, 4)
            question = f"In story number {index}, the {subject} {verb} something. What does the {subject} {verb}?"
            out.write(json.dumps({"question": question, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    with open(directory / "gen.jsonl", "w") as out:
        for index in range(generations):
            subject, verb, obj = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
            out.write(json.dumps({"question": f"Write a sentence about a {subject} that {verb} {obj} (#{index}).",
                                  "answer": ""}) + "\n")
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (directory / "bench_mc.yaml").write_text(
        f"task: bench_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n")
    (directory / "bench_gen.yaml").write_text(
        f"task: bench_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\"Question:\"]\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def timed_evaluate(model: str, model_args: str, task: str, tasks_dir: Path, **kwargs) -> float:
    """Seconds for one simple_evaluate of ``task``, the model already loaded by a first tiny run."""
    manager = TaskManager(include_path=str(tasks_dir))
    lm = lm_eval.api.registry.get_model(model).create_from_arg_string(model_args, kwargs)
    start = time.perf_counter()
    lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--questions", type=int, default=400, help="multiple-choice questions (4 choices each)")
    parser.add_argument("--generations", type=int, default=128, help="generation requests")
    parser.add_argument("--max-gen-toks", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/performance.md")
    args = parser.parse_args()
    model_args = f"pretrained={demo_model_dir()},dtype={DTYPES[args.dtype]},max_length=2048"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = Path(tmp)
        write_tasks(tasks_dir, args.questions, args.generations, args.max_gen_toks)
        for task, label in (("bench_mc", f"multiple choice, {args.questions} x 4 log-likelihoods"),
                            ("bench_gen", f"generate_until, {args.generations} x {args.max_gen_toks} tokens")):
            hf = timed_evaluate("hf", f"{model_args},device=cpu", task, tasks_dir, batch_size=args.hf_batch_size)
            ours = timed_evaluate("contbatch", model_args, task, tasks_dir)
            rows.append((label, hf, ours))
            print(f"{label}: hf {hf:.1f} s, contbatch {ours:.1f} s ({hf / ours:.2f}x)", flush=True)
    table = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `python benchmarks/lm_eval_tasks.py --dtype {args.dtype}`: "
        f"lm-eval {lm_eval.__version__}, SmolLM2-135M in {args.dtype}, {torch.get_num_threads()} threads, "
        f"hf backend batch_size={args.hf_batch_size}; CPU: {cpu_description()}. Wall time of one `simple_evaluate` "
        "per task, model already loaded.",
        "",
        *markdown_table(["task", "hf backend (s)", "contbatch (s)", "contbatch speed vs hf"],
                        [[label, f"{hf:.1f}", f"{ours:.1f}", f"{hf / ours:.2f}x"] for label, hf, ours in rows]),
    ])
    print(table)
    if args.update_docs:
        replace_marked(f"lm-eval-{args.dtype}-{cpu_kind()}", table)


if __name__ == "__main__":
    main()
