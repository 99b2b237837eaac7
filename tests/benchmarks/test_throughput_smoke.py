"""The throughput harness end to end on 8 tiny requests (contbatch only), plus its FLOP count and docs update.

No timing is asserted: only that the run completes and its JSON is whole and adds up.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _report import markers, update_docs  # noqa: E402
from _roofline import ModelFlops, torch_has_fast_bf16_matmuls  # noqa: E402
from _workloads import load_workload  # noqa: E402

NUM_REQUESTS, CAP = 8, 8


@pytest.fixture(scope="module")
def report(smollm_dir, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("results")
    command = [
        sys.executable, str(BENCHMARKS / "throughput.py"),
        "--systems", "contbatch", "--model", str(smollm_dir),
        "--limit", str(NUM_REQUESTS), "--max-tokens-cap", str(CAP),
        "--decode-batch", "4", "--matmul-size", "128", "--out-dir", str(out_dir),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out_dir.glob("*.json")
    return json.loads(path.read_text())


def test_report_has_run_description(report):
    assert report["workload"] == "chat256" and report["dtype"] == "bf16"
    assert report["num_requests"] == NUM_REQUESTS
    assert {"cpu", "cpu_kind", "torch", "transformers", "load_avg_1min"} <= set(report["machine"])
    measured = {dtype for dtype, rates in report["matmul_gflops"].items() if rates["peak"] > 0}
    assert measured == ({"bf16", "fp32"} if torch_has_fast_bf16_matmuls() else {"fp32"})
    assert report["roofline"]["ceiling_wall_s"] > 0
    assert list(report["systems"]) == ["contbatch"]


def test_contbatch_counts_add_up(report, smollm_dir):
    from transformers import AutoTokenizer

    result = report["systems"]["contbatch"]
    requests = load_workload("chat256", AutoTokenizer.from_pretrained(smollm_dir), NUM_REQUESTS, CAP)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    assert result["num_requests"] == NUM_REQUESTS
    assert result["prompt_tokens"] == prompt_tokens
    assert result["output_tokens"] == NUM_REQUESTS * CAP
    assert result["output_tokens_missing"] == 0
    assert [row[2] for row in result["requests"]] == [CAP] * NUM_REQUESTS
    for key in ("wall_s", "output_tok_s", "total_tok_s", "ttft_median_s", "ttft_p99_s", "peak_rss_mib",
                "fraction_of_ceiling", "steps_per_s", "mean_running_batch", "step_time_share_outside_model"):
        assert result[key] > 0, key

    samples = [dict(zip(result["step_fields"], s)) for s in result["step_samples"]]
    assert len(samples) == result["steps"]
    assert sum(s["sampled"] for s in samples) == NUM_REQUESTS * CAP
    # Every prompt token but the cached ones, and every output token but the last, goes through the model once.
    fed = prompt_tokens - result["cached_prompt_tokens"] + NUM_REQUESTS * (CAP - 1)
    assert sum(s["tokens"] for s in samples) == fed
    assert 0 < result["kv_blocks_used_peak"] <= result["kv_blocks_total"]
    assert result["preemptions"] == 0
    assert 0 <= result["prefix_cache_hit_rate"] <= 1

    probe = result["decode_probe"]
    assert probe["batch"] == 4 and probe["decode_steps"] > 0
    assert probe["fraction_of_peak"] > 0


def test_chat256_flops_match_the_hand_count(smollm_dir):
    from transformers import AutoTokenizer

    requests = load_workload("chat256", AutoTokenizer.from_pretrained(smollm_dir))
    assert ModelFlops.from_config(smollm_dir).workload_flops(requests) / 1e12 == pytest.approx(8.99, abs=0.01)


def test_update_docs_rewrites_only_the_marked_section(report, tmp_path):
    pytest.importorskip("matplotlib")
    docs = tmp_path / "performance.md"
    kind = report["machine"]["cpu_kind"]  # each kind of CPU has its own sections
    begin, end = markers(f"chat256-bf16-{kind}")
    other_begin, other_end = markers(f"chat256-fp32-{kind}")
    other_cpu = "".join(markers("chat256-bf16-some-other-cpu"))
    untouched = f"{other_begin}\nfp32 table\n{other_end}\n{other_cpu}\n"
    docs.write_text(f"# Hand-written\n\n{begin}\nold\n{end}\n\n{untouched}\n## Kernels\nkept\n")
    update_docs(report, "new table", docs)
    assert docs.read_text() == f"# Hand-written\n\n{begin}\nnew table\n{end}\n\n{untouched}\n## Kernels\nkept\n"
    assert (tmp_path / f"performance_throughput_chat256-bf16-{kind}.png").stat().st_size > 0


def test_report_states_the_tail_step_floor(report):
    roofline = report["roofline"]
    assert roofline["copy_gbs"] > 0
    assert roofline["weight_bytes"] == ModelFlops(**roofline["model"]).weight_bytes(2)  # bf16
    assert roofline["weight_stream_s"] == pytest.approx(roofline["weight_bytes"] / (roofline["copy_gbs"] * 1e9))


def test_a_failed_system_is_a_row_saying_so():
    from _report import _system_row

    row = _system_row("hf_static", {"error": "exit code 1: boom"}, 256)  # its label needs a batch size
    assert row.startswith("| hf_static | failed: see the run's JSON |")


def test_int8_details_compare_small_batch_decode_steps():
    from _report import _int8_details

    fields = ["batch", "tokens", "sampled", "context_sum", "kv_blocks_used", "step_s", "model_s"]

    def result(prefill_s: float, one_s: float, four_s: float, big_s: float, **extra) -> dict:
        steps = [[4, 300, 4, 300, 20, prefill_s, prefill_s],  # a prefill step: not a decode step
                 [1, 1, 1, 90, 20, one_s, one_s],
                 [4, 4, 4, 400, 20, four_s, four_s],
                 [9, 9, 9, 900, 20, big_s, big_s]]  # 9 running: outside 1-8
        return {"step_fields": fields, "step_samples": steps, "wall_s": 10.0, **extra}

    agreement = {"requests_identical": 0.5, "requests": 2, "tokens_before_divergence": 0.5}
    int8 = result(9.0, 0.006, 0.012, 1.0, agreement_with_contbatch=agreement)
    unquantized = result(1.0, 0.010, 0.020, 0.001)
    line = _int8_details(int8, unquantized)
    assert "1 running 6.0 against 10.0 ms (0.60x)" in line
    assert "1-8 running 9.0 against 15.0 ms (0.60x)" in line


def test_int8_dtype_runs_int8_beside_another_unquantized_dtype_in_one_run(smollm_dir, tmp_path):
    from _report import markdown_section

    command = [
        sys.executable, str(BENCHMARKS / "throughput.py"),
        "--systems", "contbatch,contbatch_int8", "--dtype", "fp32", "--int8-dtype", "bf16",
        "--model", str(smollm_dir), "--limit", "2", "--max-tokens-cap", "4",
        "--decode-batch", "0", "--matmul-size", "128", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    systems = report["systems"]
    assert systems["contbatch"]["config"]["dtype"] == "fp32"
    assert systems["contbatch_int8"]["config"]["dtype"] == "bf16"
    section = markdown_section(report)
    assert "| contbatch, int8 weights and activations, bf16 elsewhere |" in section
    assert "| contbatch |" in section
    assert "int8 against contbatch (int8 with bf16 elsewhere, contbatch in fp32)" in section
