"""Quality of int8 weights (``LLM(quantization="int8")``) against the unquantized model, on SmolLM2-135M.

Two measures, each run once unquantized (--dtype) and once in int8 (the layers left dense in
--dtype), one model at a time:
- perplexity over benchmarks/data/perplexity_text.txt (Shakespeare, 21,521 tokens), scored by
  contbatch's rolling log-likelihood (the lm-eval backend's ``loglikelihood_rolling``:
  disjoint windows of --window tokens, the same windows for both models);
- greedy-token agreement on throughput.py's chat256 workload (greedy, each request to its
  max_tokens or EOS): the share of requests whose tokens are identical to the unquantized
  model's, and the share of each request's tokens before its first difference, averaged.

Prints a markdown table (CPU and kernel tier named); --update-docs writes it into
docs/performance.md. No timings.

    python benchmarks/int8_quality.py [--dtype fp32|bf16] [--no-quantize-lm-head] [--update-docs]
    python benchmarks/int8_quality.py --kv-cache-dtype int8                     # int8 weights and KV cache
    python benchmarks/int8_quality.py --weights dense --kv-cache-dtype int8     # the int8 KV cache alone
    python benchmarks/int8_quality.py --max-chars 2000 --window 256 --requests 4 --max-tokens 4   # a quick check
"""

import argparse
import gc
import math
import shlex
import sys
import time

import torch
from lm_eval.api.instance import Instance
from transformers import AutoTokenizer

from contbatch import LLM, SamplingParams, ops
from contbatch.demo_model import demo_model_dir
from contbatch.integrations.lm_eval import ContbatchLM
from contbatch.ops.int8_blocks import QMAX

from _machine import cpu_description, cpu_kind
from _report import markdown_table, replace_marked
from _results import greedy_agreement
from _roofline import DTYPES
from _workloads import REPO_ROOT, load_workload

TEXT_PATH = REPO_ROOT / "benchmarks" / "data" / "perplexity_text.txt"
TARGET_PERCENT = 1.0  # int8 perplexity at most this much above the unquantized model's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="the unquantized model's dtype, and that of the int8 model's dense layers")
    parser.add_argument("--weights", choices=("int8", "dense"), default="int8",
                        help="the second model's weights: int8 (LLM's quantization='int8') or as the first's")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="the second model's KV cache (LLM's kv_cache_dtype)")
    parser.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="quantize the LM head too (LLM's quantize_lm_head)")
    parser.add_argument("--window", type=int, default=None,
                        help="tokens per perplexity window (default: the model's context less 2)")
    parser.add_argument("--max-chars", type=int, default=None, help="score only the text's first N characters")
    parser.add_argument("--requests", type=int, default=None, help="the first N chat256 requests only")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens")
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/performance.md")
    args = parser.parse_args(argv)
    if args.weights == "dense" and args.kv_cache_dtype == "auto":
        parser.error("--weights dense with --kv-cache-dtype auto compares the model with itself")
    for name in ("window", "max_chars", "requests", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def perplexity(llm_kwargs: dict, text: str, window: int | None) -> tuple[float, int, int]:
    """(perplexity, tokens scored, window) of ``text``, every token scored once."""
    lm = ContbatchLM(pretrained=str(demo_model_dir()), max_length=window, **llm_kwargs)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (logprob,) = lm.loglikelihood_rolling([request])
    tokens = len(lm.tok_encode(text))
    return math.exp(-logprob / tokens), tokens, lm.max_length


def greedy_tokens(llm_kwargs: dict, requests: list) -> list[list[int]]:
    llm = LLM(demo_model_dir(), **llm_kwargs)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in requests]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def measure(name: str, llm_kwargs: dict, text: str, args: argparse.Namespace, requests: list) -> dict:
    """One model's perplexity and greedy tokens; each LLM is freed before the next is built."""
    print(f"{name}: perplexity...", flush=True)
    ppl, tokens, window = perplexity(llm_kwargs, text, args.window)
    gc.collect()
    print(f"{name}: perplexity {ppl:.4f} over {tokens} tokens; {len(requests)} greedy requests...", flush=True)
    token_ids = greedy_tokens(llm_kwargs, requests)
    gc.collect()
    return {"ppl": ppl, "tokens": tokens, "window": window, "token_ids": token_ids}


def quantized_label(args: argparse.Namespace) -> str:
    """The second model, in words."""
    head = "int8" if args.quantize_lm_head else args.dtype
    parts = []
    if args.weights == "int8":
        qmax = ops.int8_weight_qmax()  # as LLM(quantization="int8") quantizes for the kernel that runs
        narrow = "" if qmax == QMAX else f", the layers but the LM head within \\|q\\| <= {qmax}"
        parts.append(f"int8 weights (activations int8 per token, LM head {head}{narrow}, the rest {args.dtype})")
    else:
        parts.append(f"{args.dtype} weights")
    if args.kv_cache_dtype == "int8":
        parts.append("int8 KV cache")
    return ", ".join(parts)


def report_table(args: argparse.Namespace, command: str, dense: dict, int8: dict, agreement: dict) -> str:
    increase = 100 * (int8["ppl"] / dense["ppl"] - 1)
    excerpt = f"its first {args.max_chars:,} characters" if args.max_chars else "all of it"
    output_tokens = sum(len(ids) for ids in dense["token_ids"])
    return "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `{command}`: SmolLM2-135M-Instruct, "
        f"{torch.get_num_threads()} threads; CPU: {cpu_description()}. Perplexity over {dense['tokens']:,} tokens of "
        f"benchmarks/data/perplexity_text.txt ({excerpt}), disjoint windows of {dense['window']:,} tokens; greedy "
        f"tokens of {agreement['requests']} chat256 requests ({output_tokens:,} tokens from the {args.dtype} model), "
        "each to its max_tokens or EOS.",
        "",
        *markdown_table(
            ["model", "perplexity", f"vs {args.dtype} (target: at most +{TARGET_PERCENT:.1f}%)",
             f"requests with tokens identical to {args.dtype}'s", "tokens before the first difference (mean)"],
            [[args.dtype, f"{dense['ppl']:.4f}", "", "", ""],
             [quantized_label(args), f"{int8['ppl']:.4f}",
              f"{increase:+.2f}%", f"{agreement['requests_identical']:.1%}", f"{agreement['leading_share_mean']:.1%}"]],
        ),
    ])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    text = TEXT_PATH.read_text()[: args.max_chars]
    dense_kwargs = {"dtype": DTYPES[args.dtype]}
    int8_kwargs = {**dense_kwargs, "kv_cache_dtype": args.kv_cache_dtype}
    if args.weights == "int8":
        int8_kwargs.update(quantization="int8", quantize_lm_head=args.quantize_lm_head)
    requests = load_workload("chat256", AutoTokenizer.from_pretrained(demo_model_dir()), args.requests, args.max_tokens)
    dense = measure(args.dtype, dense_kwargs, text, args, requests)
    int8 = measure("int8", int8_kwargs, text, args, requests)
    agreement = greedy_agreement(dense["token_ids"], int8["token_ids"])
    table = report_table(args, "python benchmarks/int8_quality.py " + shlex.join(argv), dense, int8, agreement)
    print(table)
    if args.update_docs:
        kind = "" if args.weights == "int8" and args.kv_cache_dtype == "auto" else \
            f"-{args.weights}-kv-{args.kv_cache_dtype}"
        replace_marked(f"int8-quality-{args.dtype}{kind}-{cpu_kind()}", table)


if __name__ == "__main__":
    main()
