"""Memory stays flat however long the input: nothing is kept per finished record but its id."""

import json
import time

from tests.jobs.helpers import cli_command, start_cli

NUM_PROMPTS = 50_000  # ~25 s on one core of a busy 2-core machine
GROWTH_BOUND_MIB = 16  # the id set itself is ~5 MiB for 50k string ids


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def test_rss_is_flat_over_50k_prompts(tmp_path, chat_model_dir):
    source = tmp_path / "in.jsonl"
    with open(source, "w") as out:
        for index in range(NUM_PROMPTS):
            out.write(json.dumps({"id": f"record-{index:06d}", "prompt": f"p {index}"}) + "\n")
    output = tmp_path / "out.jsonl"
    # On the CPU: what a job keeps per record does not depend on the device, and on a GPU the
    # CUDA driver also grows host memory as it loads each kernel on first use.
    command = cli_command(source, output, chat_model_dir, "--max-tokens", "1", "--max-num-seqs", "64",
                          "--device", "cpu")
    process = start_cli(command)
    samples = []  # (records written, RSS MiB)
    written = 0
    results = None
    while process.poll() is None:
        if results is None and output.exists():
            results = open(output, "rb")
        if results is not None:
            written += results.read().count(b"\n")
        rss = _rss_mib(process.pid)
        if rss is not None:
            samples.append((written, rss))
        time.sleep(0.1)
    _, stderr = process.communicate()
    if results is not None:
        results.close()
    assert process.returncode == 0, stderr
    assert sum(1 for _ in open(output, "rb")) == NUM_PROMPTS

    def peak(low: float, high: float) -> float:
        window = [rss for count, rss in samples if low * NUM_PROMPTS <= count <= high * NUM_PROMPTS]
        assert window, f"no RSS samples between {low:.0%} and {high:.0%} of the run"
        return max(window)

    # Both windows lie while records are being written: what a job keeps per record shows
    # there. After the last one the process winds up, and on a GPU machine's CUDA build of torch
    # its RSS rose once by 85 MiB then (docs/performance.md, the CUDA path's fourth run), which
    # says nothing of what a longer input would need.
    early, late = peak(0.1, 0.3), peak(0.7, 0.95)
    assert late - early < GROWTH_BOUND_MIB, (
        f"RSS grew from {early:.0f} MiB to {late:.0f} MiB; {_curve(samples)}")


def _curve(samples: list[tuple[int, float]]) -> str:
    """Peak RSS per tenth of the records written, and after the last one: whether memory grew
    steadily (kept per record) or in one jump (a one-off allocation) tells the causes apart."""
    tenth = NUM_PROMPTS // 10
    peaks: dict[int, float] = {}
    for count, rss in samples:
        bucket = min(count // tenth, 10)
        peaks[bucket] = max(peaks.get(bucket, 0.0), rss)
    return "peak MiB by records written: " + ", ".join(
        f"{bucket * 10}%: {rss:.0f}" for bucket, rss in sorted(peaks.items()))
