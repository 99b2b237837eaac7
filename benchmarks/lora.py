"""What serving LoRA adapters costs: the same generation on the base model and with adapters.

    python benchmarks/lora.py                          # bf16, 8 and 64 prompts x 64 tokens, 3 rounds
    python benchmarks/lora.py --dtype float32 --running 1,8,64,256 --rank 64

Adapters are written here with random weights in PEFT's file format (rank ``--rank``, every
projection of every layer: the most work an adapter can add), so no PEFT install is needed.
Configurations, each loaded once and alternated in every round so that a shared machine's
drift falls on all alike; the best round of each is reported, with its ratio to the base model:

- base: no adapter (the C++ decoder stack runs every step);
- base, Python layers: no adapter, ``CONTBATCH_NATIVE_DECODER=0``: what a step costs on the
  Python decoder layers, which every step with adapter rows runs;
- one adapter: every request with the same adapter;
- two adapters: half the requests with each (``max_loras=2``), so every step has two.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from _machine import cpu_description
from contbatch import LLM, LoRARequest, SamplingParams
from contbatch.demo_model import demo_model_dir

PROMPT = "Write a long story about a cat and a dog who travel the world together."
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection, shaped from the model's own weights."""
    from safetensors import safe_open

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                parts = name.split(".")
                if not (name.endswith(".weight") and len(parts) == 6 and parts[4] in PROJECTIONS.get(parts[3], ())):
                    continue
                out_features, in_features = weights.get_slice(name).get_shape()
                module = name.removesuffix(".weight")
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_features, rank, generator=generator) * 0.01
                tensors[f"base_model.model.{module}.lora_A.weight"] = a
                tensors[f"base_model.model.{module}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({p for group in PROJECTIONS.values() for p in group})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def load(model: str, dtype: str, rank: int, native: bool) -> LLM:
    os.environ["CONTBATCH_NATIVE_DECODER"] = "1" if native else "0"  # read as the model loads
    return LLM(model, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=rank, enable_prefix_caching=False)


def run_s(llm: LLM, running: int, tokens: int, loras: list[LoRARequest | None]) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPT + " " * i for i in range(running)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--running", default="8,64", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = Path(args.model or demo_model_dir())
    with tempfile.TemporaryDirectory() as scratch:
        first, second = (LoRARequest(f"random-{i}", i, str(write_adapter(model, Path(scratch) / str(i), args.rank, i)))
                         for i in (1, 2))
        native, python = load(str(model), args.dtype, args.rank, True), load(str(model), args.dtype, args.rank, False)
        print(f"# {cpu_description()}, {torch.get_num_threads()} threads, {args.dtype}, rank {args.rank} on every "
              f"projection, {args.tokens} tokens a request, best of {args.rounds} alternated rounds, seconds")
        print("| running | base | base, Python layers | one adapter | two adapters |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for running in (int(n) for n in args.running.split(",")):
            configs = {
                "base": (native, [None] * running),
                "python": (python, [None] * running),
                "one": (native, [first] * running),
                "two": (native, [first if i % 2 else second for i in range(running)]),
            }
            times = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, (llm, loras) in configs.items():
                    times[name].append(run_s(llm, running, args.tokens, loras))
            best = {name: min(t) for name, t in times.items()}
            cells = " | ".join(f"{best[name]:.2f} ({best[name] / best['base']:.2f}x)" for name in configs)
            print(f"| {running} | {cells} |")


if __name__ == "__main__":
    main()
