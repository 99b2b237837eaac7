"""Turn a throughput report into markdown and a plot, and put them into docs/performance.md."""

from pathlib import Path

from _workloads import REPO_ROOT

DOCS_PATH = REPO_ROOT / "docs" / "performance.md"
PLOT_NAME = "performance_throughput.png"
BEGIN, END = "<!-- throughput:begin -->", "<!-- throughput:end -->"

SYSTEM_LABELS = {
    "contbatch": "contbatch",
    "hf_static": "HF generate, static batches of {batch_size}",
    "hf_cb": "HF continuous batching",
    "hf_serial": "HF generate, one request at a time",
}


def markdown_section(report: dict) -> str:
    """The generated part of docs/performance.md (without the markers)."""
    machine, roofline = report["machine"], report["roofline"]
    systems = report["systems"]
    threads = next((r["num_threads"] for r in systems.values() if "num_threads" in r), "?")
    first = next((r for r in systems.values() if "error" not in r), None)
    lines = [
        f"Measured {report['date']} with `{report['command']}`.",
        f"CPU: {machine['cpu']} ({machine['cores']} cores, avx512_bf16: {'yes' if machine['avx512_bf16'] else 'no'}), "
        f"{threads} torch threads; torch {machine['torch']}, transformers {machine['transformers']}; "
        f"load average {machine['load_avg_1min']:.2f} at the start.",
        f"Workload `{report['workload']}`: {report['num_requests']} requests"
        + (f", {first['prompt_tokens']:,} prompt + {first['output_tokens']:,} output tokens" if first else "")
        + f"; SmolLM2-135M-Instruct in {report['dtype']}, greedy, EOS ignored (every request runs to its max_tokens).",
        "",
        "| System | Wall (s) | Output tok/s | Total tok/s | TTFT median (s) | TTFT p99 (s) | Peak RSS (MiB) | Of ceiling |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [_system_row(name, result, report["num_requests"]) for name, result in systems.items()]
    lines += [
        "",
        f"Ceiling: {roofline['workload_tflop']:.2f} TFLOP of matmuls at this machine's measured {report['dtype']} "
        f"matmul peak of {roofline['peak_gflops']:.0f} GFLOP/s is {roofline['ceiling_wall_s']:.1f} s, "
        f"{roofline['ceiling_output_tok_s']:.0f} output tok/s ({_rates(report)}). "
        "\"Of ceiling\" is ceiling time / wall time.",
    ]
    if "contbatch" in systems and "error" not in systems["contbatch"]:
        lines += ["", *_contbatch_details(systems["contbatch"])]
    lines += ["", f"![throughput]({PLOT_NAME})", "", *_notes(systems)]
    return "\n".join(lines)


def _system_row(name: str, result: dict, num_requests: int) -> str:
    label = SYSTEM_LABELS[name].format(**result.get("config", {}))
    if "error" in result:
        return f"| {label} | failed: see the run's JSON | | | | | | |"
    wall = f"{result['wall_s']:.1f}"
    if result.get("extrapolated"):
        label += f" (first {result['num_requests']} of {num_requests}, extrapolated)"
        wall = f"{result['extrapolated_wall_s']:.1f} (est.)"
    return (
        f"| {label} | {wall} | {result['output_tok_s']:.1f} | {result['total_tok_s']:.1f} | "
        f"{result['ttft_median_s']:.2f} | {result['ttft_p99_s']:.2f} | {result['peak_rss_mib']:.0f} | "
        f"{result['fraction_of_ceiling']:.1%} |"
    )


def _rates(report: dict) -> str:
    return "; ".join(
        f"{dtype}: " + ", ".join(f"{shape} {gflops:.0f}" for shape, gflops in rates.items() if shape != "peak")
        for dtype, rates in report["matmul_gflops"].items()
    ) + " GFLOP/s"


def _contbatch_details(result: dict) -> list[str]:
    lines = [
        "contbatch per step:",
        "",
        "| Steps/s | Mean running batch | Step time outside model forward | KV blocks used (peak) | Preemptions | "
        "Prefix-cache hit rate |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {result['steps_per_s']:.1f} | {result['mean_running_batch']:.1f} | "
        f"{result['step_time_share_outside_model']:.1%} | {result['kv_blocks_used_peak']} of "
        f"{result['kv_blocks_total']} ({result['block_size']} tokens each) | {result['preemptions']} | "
        f"{result['prefix_cache_hit_rate']:.1%} |",
    ]
    probe = result.get("decode_probe")
    if probe and probe.get("gflops"):
        lines += [
            "",
            f"Decode only, {probe['batch']} sequences running ({probe['prompt_len']}-token prompts, "
            f"{probe['decode_steps']} full-batch decode steps): {probe['output_tok_s']:.0f} output tok/s, "
            f"{probe['gflops']:.0f} GFLOP/s = {probe['fraction_of_peak']:.1%} of the matmul peak "
            f"(model forward alone: {probe['model_fraction_of_peak']:.1%}).",
        ]
    return lines


def _notes(systems: dict) -> list[str]:
    notes = [
        "Notes:",
        "- Tokens are counted as asked for (prompt + max_tokens); tokens a static batch generates past a "
        "request's max_tokens are not counted. Model loading and a 2-request warm-up are not timed.",
        "- TTFT is measured from the start of the timed run, when the whole workload is submitted at once. "
        "For HF static batching it is when the request's batch produced its first token (a streamer on "
        "generate() records it), so later batches include the wait for earlier ones.",
    ]
    if "hf_serial" in systems:
        notes.append(
            "- HF one-at-a-time TTFT is each request's own (from its generate() call), over the measured requests "
            "only; its wall time is extrapolated from the measured total tok/s."
        )
    if "hf_cb" in systems and "config" in systems["hf_cb"]:
        config = ", ".join(f"{k}={v}" for k, v in systems["hf_cb"]["config"].items())
        notes.append(f"- HF continuous batching (init_continuous_batching, no torch.compile): {config}.")
    return notes


def update_docs(report: dict, section: str, docs_path: Path = DOCS_PATH) -> None:
    """Replace the marked throughput section of docs/performance.md and write the plot beside it."""
    text = docs_path.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{docs_path} must contain {BEGIN} followed by {END}; add them where the results go")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    docs_path.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")
    plot(report, docs_path.parent / PLOT_NAME)
    print(f"updated {docs_path} and {docs_path.parent / PLOT_NAME}")


def plot(report: dict, path: Path) -> None:
    """Output tok/s per system, and contbatch's per-step throughput against running sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {name: r for name, r in report["systems"].items() if "error" not in r}
    fig, (bars, steps) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(systems)
    labels = [name + (" (est.)" if systems[name].get("extrapolated") else "") for name in names]
    bars.barh(labels, [systems[n]["output_tok_s"] for n in names], color="tab:blue")
    bars.axvline(report["roofline"]["ceiling_output_tok_s"], color="tab:red", linestyle="--", label="compute ceiling")
    bars.set_xlabel("output tokens/s")
    bars.set_title(f"{report['workload']}, {report['dtype']}")
    bars.invert_yaxis()
    bars.legend(loc="lower right")
    contbatch = systems.get("contbatch")
    if contbatch:
        fields = contbatch["step_fields"]
        batch, tokens, step_s = (fields.index(f) for f in ("batch", "tokens", "step_s"))
        samples = contbatch["step_samples"]
        for kind, keep, marker in (("decode only", True, "o"), ("with prefill", False, "x")):
            chosen = [s for s in samples if (s[tokens] == s[batch]) == keep]
            steps.scatter(
                [s[batch] for s in chosen], [s[tokens] / s[step_s] for s in chosen], s=8, marker=marker, label=kind
            )
        steps.set_xlabel("running sequences in the step")
        steps.set_ylabel("tokens processed per second in the step")
        steps.set_yscale("log")
        steps.set_title("contbatch, one point per step")
        steps.legend()
    else:
        steps.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
