"""chat256 on one NVIDIA GPU: contbatch (its CUDA path) against HF transformers generate().

Both get the same prompt token ids, greedy, EOS ignored, each request to its own
max_tokens, in bf16 on the GPU, one after the other in one process (HF's model is freed
before contbatch loads). HF runs static batches of ``--hf-batch-size`` in workload order,
left-padded, sdpa attention, each batch to its longest request. Reports output tok/s, load
time and greedy token agreement. ``--random-weights`` initialises the model directory's
architecture with random weights (only config.json and the tokenizer are read): for a GPU
machine the real weights cannot reach; the speed of a model does not depend on its
weights, but its agreement figure is then over near-ties of a random model.

    python benchmarks/gpu_throughput.py --model DIR [--random-weights] [--out results.json]
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from _hf_systems import left_padded
from _results import greedy_agreement, summarize
from _workloads import load_workload


def _timed(fn, device: str):
    """fn()'s result and its wall time, with the GPU's queue drained before and after."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def materialize_random_model(model_dir: Path, target: Path, seed: int = 0) -> Path:
    """``model_dir``'s architecture with random weights (bf16) and its tokenizer, saved in ``target``."""
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


def run_hf(model_dir: Path, requests: list, batch_size: int, device: str) -> dict:
    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(device).eval()
    load_s = time.perf_counter() - load_start
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _hf_batch(model, requests[:batch_size], pad)  # warm-up: CUDA context, kernels, allocator
    token_ids: list[list[int]] = []

    def run_all() -> None:
        for index in range(0, len(requests), batch_size):
            token_ids.extend(_hf_batch(model, requests[index : index + batch_size], pad))

    _, wall = _timed(run_all, device)
    result = summarize(requests, wall, [0.0] * len(requests), [len(t) for t in token_ids], load_s, 0.0)
    result["token_ids"] = token_ids
    result["config"] = {"batch_size": batch_size, "attn": "sdpa"}
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


@torch.inference_mode()
def _hf_batch(model, batch: list, pad: int) -> list[list[int]]:
    """Each request's generated ids (cut at its max_tokens) from one left-padded generate()."""
    input_ids, mask = left_padded(batch, pad)
    width = input_ids.shape[1]
    longest = max(r.max_tokens for r in batch)
    config = GenerationConfig(do_sample=False, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                         generation_config=config)
    return [out[row, width : width + r.max_tokens].tolist() for row, r in enumerate(batch)]


def run_contbatch(model_dir: Path, requests: list, max_num_seqs: int, device: str) -> dict:
    from contbatch import LLM, SamplingParams

    load_start = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_num_seqs=max_num_seqs, seed=0)
    load_s = time.perf_counter() - load_start

    def generate(batch: list) -> list:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in batch]
        return llm.generate(prompts, params, use_tqdm=False)

    generate(requests[:16])  # warm-up
    outputs, wall = _timed(lambda: generate(requests), device)
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    result = summarize(requests, wall, [0.0] * len(requests), [len(t) for t in token_ids], load_s, 0.0)
    result["token_ids"] = token_ids
    result["config"] = {"max_num_seqs": max_num_seqs, "block_size": llm.engine.config.block_size,
                        "steps": llm.engine.stats.num_steps}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF model directory")
    parser.add_argument("--random-weights", action="store_true", help="its architecture with random weights")
    parser.add_argument("--workload", default="chat256")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--limit", type=int, help="the first N requests only")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: to try the script on a machine without one)")
    parser.add_argument("--out", type=Path, default=Path("gpu_throughput.json"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_throughput.py: torch sees no CUDA GPU")
    model_dir = args.model
    if args.random_weights:
        model_dir = materialize_random_model(args.model, Path(tempfile.mkdtemp(prefix="random-weights-")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = load_workload(args.workload, tokenizer, limit=args.limit)
    results = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "model": str(args.model) + (" (random weights)" if args.random_weights else ""),
        "workload": args.workload,
        "hf_static": run_hf(model_dir, requests, args.hf_batch_size, args.device),
        "contbatch": run_contbatch(model_dir, requests, args.max_num_seqs, args.device),
    }
    results["agreement"] = greedy_agreement(results["hf_static"].pop("token_ids"),
                                            results["contbatch"].pop("token_ids"))
    for system in ("hf_static", "contbatch"):
        row = results[system]
        print(f"{system:10s} output {row['output_tok_s']:9.1f} tok/s  wall {row['wall_s']:6.2f} s  "
              f"load {row['load_s']:5.2f} s  missing {row['output_tokens_missing']}")
    print("greedy agreement (HF as reference):", json.dumps(results["agreement"]))
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
