"""Beam search: contbatch's ``LLM.beam_search`` against HF transformers' ``generate(num_beams=...)``.

    python benchmarks/beam_search.py                       # 8 prompts, beam_width 4, 32 tokens, fp32
    python benchmarks/beam_search.py --beam-width 2 --tokens 64 --dtype bfloat16

Both run the demo model on the same prompts, every beam to ``--tokens`` tokens (EOS ignored,
HF held to its ``min_new_tokens``), after a warm-up. contbatch searches all prompts at once
(each step one batch of every live beam); HF runs one prompt at a time, its beams batched.
The two searches rank beams by the same length-penalised score but differ in when finished
beams leave, so the sequences may differ; this times the work, not the agreement (that is
tests/test_beam_search.py's). Reports wall seconds and the tokens contbatch's steps computed
(the prompts once, then one a beam a step: each continues from its parent's kept K/V).
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from _machine import cpu_description
from contbatch import LLM, BeamSearchParams
from contbatch.demo_model import demo_model_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn",
           "Water boils at", "In 1492,", "My favourite food is", "The sun is"]


def contbatch_s(model: str, dtype: str, params: BeamSearchParams) -> tuple[float, int]:
    llm = LLM(model, dtype=dtype)
    llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    computed = []
    llm.engine.add_stats_listener(lambda stats: computed.append(stats.num_scheduled_tokens))
    start = time.perf_counter()
    llm.beam_search(PROMPTS, params)
    return time.perf_counter() - start, sum(computed)


def hf_s(model: str, dtype: str, params: BeamSearchParams) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    settings = dict(num_beams=params.beam_width, max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens,
                    do_sample=False, early_stopping=False, length_penalty=params.length_penalty,
                    pad_token_id=tokenizer.eos_token_id)
    with torch.inference_mode():
        hf.generate(tokenizer(PROMPTS[0], return_tensors="pt").input_ids, **{**settings, "max_new_tokens": 2,
                                                                               "min_new_tokens": 2})
        start = time.perf_counter()
        for prompt in PROMPTS:
            hf.generate(tokenizer(prompt, return_tensors="pt").input_ids, **settings)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(demo_model_dir())
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.tokens, ignore_eos=True)
    ours, computed = contbatch_s(model, args.dtype, params)
    theirs = hf_s(model, args.dtype, params)
    print(f"# {cpu_description()}, {torch.get_num_threads()} threads, {args.dtype}, {len(PROMPTS)} prompts, "
          f"beam_width {args.beam_width}, {args.tokens} tokens")
    print(f"contbatch beam_search: {ours:.2f} s ({computed:,} tokens computed for "
          f"{len(PROMPTS) * args.beam_width * args.tokens:,} generated)")
    print(f"HF generate(num_beams={args.beam_width}), one prompt at a time: {theirs:.2f} s ({theirs / ours:.2f}x)")


if __name__ == "__main__":
    main()
