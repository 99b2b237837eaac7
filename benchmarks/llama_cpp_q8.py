"""llama.cpp's Q8_0 beside contbatch's int8 on the same GGUF file and the same chat256 requests.

    python benchmarks/llama_cpp_q8.py --gguf SmolLM2-135M-Instruct.Q8_0.gguf --venv /tmp/llamavenv --limit 16

llama.cpp runs in its own venv (``python -m venv V && V/bin/pip install llama-cpp-python``),
one request at a time, as its Python API does. contbatch loads the same file (its Q8_0 layers
run on the int8 kernels as stored) and runs the same requests twice: one at a time
(``max_num_seqs=1``, the like-for-like decode speed) and all together (what a user of the
offline API gets). Greedy, EOS ignored, every request to its own max_tokens.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from contbatch import LLM, SamplingParams, ops

from _machine import cpu_description
from _report import markdown_table
from _results import greedy_agreement, run_subprocess
from _workloads import load_workload

CHILD = Path(__file__).resolve().parent / "_llama_cpp_child.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="a GGUF file with Q8_0 linear layers")
    parser.add_argument("--venv", type=Path, required=True, help="a venv with llama-cpp-python installed")
    parser.add_argument("--limit", type=int, default=16, help="the first N chat256 requests")
    parser.add_argument("--dtype", default="bfloat16", help="contbatch's dtype for its dense parts")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    return parser.parse_args()


def run_llama_cpp(args: argparse.Namespace, requests: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        n_ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 8
        job.write_text(json.dumps({"model": str(args.gguf), "threads": args.threads, "n_ctx": n_ctx,
                                   "requests": [[r.prompt_token_ids, r.max_tokens] for r in requests]}))  # fmt: skip
        result = run_subprocess([str(args.venv / "bin" / "python"), "-I", str(CHILD), str(job), str(out)],
                                dict(os.environ), out)  # fmt: skip
    if "error" in result:
        raise SystemExit(f"llama.cpp failed: {result['error']}")
    return result


def run_contbatch(args: argparse.Namespace, requests: list, max_num_seqs: int) -> dict:
    llm = LLM(args.gguf, dtype=args.dtype, quantization="int8", max_num_seqs=max_num_seqs)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"wall_s": time.perf_counter() - start, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    requests = load_workload("chat256", tokenizer, args.limit)
    output_tokens = sum(r.max_tokens for r in requests)
    llama = run_llama_cpp(args, requests)
    alone = run_contbatch(args, requests, max_num_seqs=1)
    together = run_contbatch(args, requests, max_num_seqs=256)
    rows = []
    for name, result in (("llama.cpp Q8_0, one request at a time", llama),
                         ("contbatch int8, one request at a time", alone),
                         ("contbatch int8, all requests together", together)):  # fmt: skip
        agreement = greedy_agreement(llama["token_ids"], result["token_ids"])
        rows.append([name, f"{result['wall_s']:.1f}", f"{output_tokens / result['wall_s']:.1f}",
                     f"{agreement['requests_identical']:.0%}", f"{agreement['tokens_before_divergence']:.0%}"])  # fmt: skip
    print(f"CPU: {cpu_description()}, {args.threads} threads; contbatch tier {ops.cpu_isa()}, int8 kernel "
          f"{ops.int8_kernel_isa()}, dense parts {args.dtype}; llama-cpp-python {llama['version']}; "
          f"{len(requests)} chat256 requests, {output_tokens} output tokens, greedy, EOS ignored.\n")
    print("\n".join(markdown_table(["system", "wall (s)", "output tok/s", "requests with llama.cpp's tokens",
                                          "tokens before the first difference"], rows)))


if __name__ == "__main__":
    main()
