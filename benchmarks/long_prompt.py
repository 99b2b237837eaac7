"""Times one long prompt's prefill: contbatch (chunked, max_num_batched_tokens per step, as
it runs beside decodes) against one HF transformers forward pass over the same tokens.

For each prompt length, the wall time of ``LLM.generate`` with max_tokens=1 (the prefill
and one sampled token; the LLM is built and warmed up first) and of
``model(input_ids)`` in HF (sdpa attention, no KV cache kept), both in the same dtype,
fastest of --reps. Where torch has no fast bf16 matmul (AVX2-only CPUs such as Zen 3: a
scalar fallback, _roofline.torch_has_fast_bf16_matmuls), HF runs in fp32, its fastest dtype
there, and the table says so. Prints a markdown table (CPU and kernel tier named); --update-docs
writes it into docs/performance.md.

    python benchmarks/long_prompt.py [--lengths 500,1000,2500,5000] [--dtype bf16|fp32] [--update-docs]
"""

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM

from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir

from _machine import cpu_description, cpu_kind
from _report import markdown_table, replace_marked
from _roofline import DTYPES, fastest, torch_has_fast_bf16_matmuls

# The last is SmolLM2's longest prompt: max_model_len (8,192) less the one token generated.
LENGTHS = (500, 1000, 2500, 5000, 8191)


def random_prompt(length: int, vocab_size: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated prompt lengths")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="contbatch's per-step token budget")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--update-docs", action="store_true", help="rewrite the long-prompt table of docs/performance.md")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    directory, dtype = demo_model_dir(), DTYPES[args.dtype]
    llm = LLM(directory, dtype=dtype, max_model_len=max(lengths) + 1,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    hf_dtype_name = args.dtype if args.dtype == "fp32" or torch_has_fast_bf16_matmuls() else "fp32"
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[hf_dtype_name],
                                              attn_implementation="sdpa").eval()
    vocab = hf.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for length in lengths:
        prompt = random_prompt(length, vocab)
        ours = fastest(lambda: llm.generate([prompt], params, use_tqdm=False), reps=args.reps)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            theirs = fastest(lambda: hf(ids, use_cache=False), reps=args.reps)
        rows.append((length, ours, theirs))
        print(f"{length} tokens: contbatch {ours:.2f} s, HF forward in {hf_dtype_name} {theirs:.2f} s", flush=True)
    table = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `python benchmarks/long_prompt.py --dtype {args.dtype}`: "
        f"SmolLM2-135M in {args.dtype}, {torch.get_num_threads()} threads, contbatch max_num_batched_tokens="
        f"{args.max_num_batched_tokens}; HF in {hf_dtype_name}"
        f"{'' if hf_dtype_name == args.dtype else ' (torch has no fast bf16 matmul on this CPU)'}; "
        f"CPU: {cpu_description()}. Fastest of {args.reps}.",
        "",
        *markdown_table(["prompt tokens", "contbatch prefill (s)", f"HF forward, {hf_dtype_name} (s)",
                         "contbatch speed vs HF"],
                        [[str(n), f"{ours:.2f}", f"{theirs:.2f}", f"{theirs / ours:.2f}x"] for n, ours, theirs in rows]),
    ])
    print(table)
    if args.update_docs:
        replace_marked(f"long-prompt-{args.dtype}-{cpu_kind()}", table)


if __name__ == "__main__":
    main()
