"""Offline throughput of contbatch against HF transformers baselines on SmolLM2-135M-Instruct.

Every system runs the same requests (same prompt token ids, greedy, EOS ignored, each
request to its own max_tokens) in its own subprocess, so peak RSS is per system.

    python benchmarks/throughput.py --all --dtype bf16 --update-docs
    python benchmarks/throughput.py --systems contbatch --limit 16

See benchmarks/README.md for what is measured and how.
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This script's folder is on sys.path, and its kernels.py would pass for the unrelated
# `kernels` package that transformers probes for: mark that package as absent.
sys.modules.setdefault("kernels", None)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from _report import markdown_section, update_docs  # noqa: E402
from _roofline import DTYPES, ModelFlops, ceiling, copy_bandwidth, matmul_rates  # noqa: E402
from _workloads import REPO_ROOT, WORKLOADS, load_workload, random_requests  # noqa: E402

SYSTEMS = ("contbatch", "hf_static", "hf_cb", "hf_serial")
CONTBATCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


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
    parser.add_argument("--max-num-seqs", type=int, default=256, help="contbatch max_num_seqs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="contbatch max_num_batched_tokens")
    parser.add_argument("--decode-batch", type=int, default=256, help="contbatch decode-only probe batch (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="square matmul size for the peak rate")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the throughput section of docs/performance.md")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = list(SYSTEMS) if args.all else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {unknown or 'none'}")
    for name in ("limit", "max_tokens_cap", "serial_limit", "hf_batch_size", "threads"):
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
    warmup = random_requests(tokenizer, count=2, prompt_len=16, max_tokens=4)
    dtype = DTYPES[args.dtype]
    # Each child imports only its own system, so its peak RSS holds nothing of the others.
    if args.child == "contbatch":
        from _contbatch_system import run_contbatch

        settings = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "decode_batch": args.decode_batch,
        }
        result = run_contbatch(directory, CONTBATCH_DTYPES[args.dtype], requests, warmup, tokenizer, settings)
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


def run_system(system: str, argv: list[str], threads: int | None) -> dict:
    """Run one system in a fresh subprocess; its result, or {"error": ...} if it failed."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", system, "--child-out", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
        return json.loads(out.read_text())


def machine_info() -> dict:
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {
        "cpu": fields.get("model name", platform.processor()),
        "avx512_bf16": "avx512_bf16" in fields.get("flags", "").split(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0],
    }


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    directory = model_dir(args)
    requests = load_workload(args.workload, AutoTokenizer.from_pretrained(directory), args.limit, args.max_tokens_cap)
    machine = machine_info()
    if machine["load_avg_1min"] > 0.5:
        print(f"warning: load average {machine['load_avg_1min']:.1f}: other work is running, timings will be noisy")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"matmul rates ({args.matmul_size}^3 and model-shaped, best of 3)...", flush=True)
    rates = matmul_rates(args.matmul_size)
    copy_gbs = copy_bandwidth()
    element_size = DTYPES[args.dtype].itemsize
    run_ceiling = ceiling(ModelFlops.from_config(directory), requests, rates[args.dtype]["peak"], copy_gbs, element_size)
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
    }
    for system in args.systems:
        print(f"running {system}...", flush=True)
        result = run_system(system, [*argv, "--model", str(directory)], args.threads)
        if "error" not in result:
            add_roofline(result, system, run_ceiling, len(requests))
        report["systems"][system] = result
        print(_one_line(system, result), flush=True)
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
