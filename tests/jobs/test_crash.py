"""Jobs killed (SIGKILL) or interrupted (SIGINT) part-way, then resumed, lose and duplicate nothing.

The job runs as `python -m contbatch generate` in a subprocess, or, to be killed mid-write,
as tests/jobs/hanging_job.py (run_job with the same settings and a hook that tears a line and
hangs, or hangs before renaming the finished Parquet file into place); the reference is an
uninterrupted in-process run of the same greedy job from JSONL to JSONL. The same records
come from JSONL, CSV and Parquet input, and go to JSONL or Parquet output.
"""

import random
import signal
import subprocess
import sys
import time

import pytest

from contbatch import SamplingParams
from contbatch.jobs import run_job
from contbatch.jobs.output import detect_output_format, journal_path
from tests.jobs.hanging_job import hanging_marker
from tests.jobs.helpers import (
    cli_command,
    cli_env,
    prompt_records,
    read_jsonl,
    read_parquet,
    start_cli,
    write_input,
    write_jsonl,
)

NUM_PROMPTS = 300
GREEDY = SamplingParams(temperature=0, max_tokens=8)  # what cli_command asks for
ENGINE_FLAGS = ("--max-num-seqs", "16", "--fsync-every", "50")  # small batches: results trickle out
# hanging_job.py runs run_job with the settings of cli_command(...) with ENGINE_FLAGS: keep them alike.
STARTUP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def crash_input(tmp_path_factory):
    """in.jsonl, with in.csv and in.parquet beside it holding the same records."""
    directory = tmp_path_factory.mktemp("crash")
    for name in ("in.csv", "in.parquet"):
        write_input(directory / name, prompt_records(NUM_PROMPTS))
    return write_jsonl(directory / "in.jsonl", prompt_records(NUM_PROMPTS))


@pytest.fixture(scope="module")
def reference(crash_input, chat_model_dir, chat_llm, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("reference") / "out.jsonl"
    summary = run_job(crash_input, output, model=chat_model_dir, llm=chat_llm, sampling_params=GREEDY)
    assert summary.written == NUM_PROMPTS
    return {record["id"]: record for record in read_jsonl(output)}


def _hanging_job(input_path, output, model_dir, when: int | str) -> list[str]:
    """The job's command, hanging after its ``when``th result with half a line appended, or
    (``when="rename"``) before renaming the finished Parquet file into place."""
    return [sys.executable, "-m", "tests.jobs.hanging_job", str(input_path), str(output), str(model_dir), str(when)]


def _torn(path) -> bool:
    return path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")


def _lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"job exited ({process.returncode}) before {what}: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _kill(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGKILL)
    return process.communicate()[1]


def _assert_complete(results: list[dict], reference) -> None:
    ids = [record["id"] for record in results]
    assert len(ids) == len(set(ids)), "duplicated records"
    assert set(ids) == set(reference), f"lost records: {sorted(set(reference) - set(ids))[:10]}"
    for record in results:
        assert record == reference[record["id"]]


@pytest.mark.parametrize(
    "input_name, output_name", [("in.jsonl", "out.jsonl"), ("in.csv", "out.jsonl"), ("in.parquet", "out.parquet")]
)
def test_sigkill_at_random_moments_then_resume(
    crash_input, reference, chat_model_dir, tmp_path, input_name, output_name
):
    source, output = crash_input.with_name(input_name), tmp_path / output_name
    journal = journal_path(output, detect_output_format(output, "auto"))  # the output itself for JSONL
    command = cli_command(source, output, chat_model_dir, *ENGINE_FLAGS)
    seed = random.randrange(2**32)
    print(f"kill points drawn with random.Random({seed})")  # shown if the test fails
    rng = random.Random(seed)
    for round_number in range(4):
        before = _lines(journal)
        if round_number % 2 == 0:  # killed mid-write: the hook leaves half a line and hangs
            process = start_cli(_hanging_job(source, output, chat_model_dir, rng.randint(1, 40)))
            _wait_for(hanging_marker(output).exists, process, "a torn line")
            _kill(process)
            hanging_marker(output).unlink()
            assert _torn(journal)
        else:  # killed at a random point of its progress; first it repairs the torn line
            process = start_cli(command)
            target = before + rng.randint(1, 40)
            _wait_for(lambda: _lines(journal) >= target, process, f"{target} results")
            assert "cut off a torn last line" in _kill(process)
        assert _lines(journal) < NUM_PROMPTS, "the job finished before it could be killed; make it longer"
        assert not (journal != output and output.exists()), "a Parquet file before the job was done"
    if journal != output:  # killed once every record is done, while the Parquet file is written
        process = start_cli(_hanging_job(source, output, chat_model_dir, "rename"))
        _wait_for(hanging_marker(output).exists, process, "the Parquet file")
        _kill(process)
        hanging_marker(output).unlink()
        assert _lines(journal) == NUM_PROMPTS and not output.exists()
    finished = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert "contbatch: done:" in finished.stderr
    _assert_complete(read_jsonl(journal), reference)  # every line parses: no torn line survived
    if journal != output:
        results = read_parquet(output)
        assert [r["id"] for r in results] == [r["id"] for r in prompt_records(NUM_PROMPTS)], "not in input order"
        _assert_complete(results, reference)


def test_sigint_finishes_in_flight_requests_and_exits_130(crash_input, reference, chat_model_dir, chat_llm, tmp_path):
    output = tmp_path / "out.jsonl"
    process = start_cli(cli_command(crash_input, output, chat_model_dir, *ENGINE_FLAGS))
    _wait_for(lambda: _lines(output) > 0, process, "the first result")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "finishing the requests in flight" in stderr and "rerun the same command to resume" in stderr
    written = read_jsonl(output)
    assert 0 < len(written) < NUM_PROMPTS and output.read_bytes().endswith(b"\n")
    summary = run_job(crash_input, output, model=chat_model_dir, llm=chat_llm, sampling_params=GREEDY)
    assert summary.already_done == len(written) and summary.status == "done"
    _assert_complete(read_jsonl(output), reference)


def test_second_sigint_aborts_at_once_without_tearing_a_line(crash_input, chat_model_dir, tmp_path):
    output = tmp_path / "out.jsonl"
    process = start_cli(cli_command(crash_input, output, chat_model_dir, *ENGINE_FLAGS))
    _wait_for(lambda: _lines(output) > 0, process, "the first result")
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted:" in stderr and output.read_bytes().endswith(b"\n")
    assert len(read_jsonl(output)) < NUM_PROMPTS


def test_a_sigint_while_the_process_winds_up_keeps_exit_status_130(crash_input, chat_model_dir, tmp_path):
    # Once the summary is printed every result is on disk; a Ctrl-C during Python's teardown
    # (after its own handler is gone) used to end the process by the signal instead.
    output = tmp_path / "out.jsonl"
    process = start_cli(cli_command(crash_input, output, chat_model_dir, *ENGINE_FLAGS))
    _wait_for(lambda: _lines(output) > 0, process, "the first result")
    process.send_signal(signal.SIGINT)
    stderr = []
    for line in process.stderr:
        stderr.append(line)
        if "rerun the same command to resume" in line:  # the summary: the job has wound up
            break
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:  # Ctrl-C all through the teardown
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
    stderr.append(process.communicate(timeout=60)[1])
    assert process.returncode == 130, "".join(stderr)
    assert len(read_jsonl(output)) < NUM_PROMPTS and output.read_bytes().endswith(b"\n")


def test_a_second_sigint_during_a_write_waits_for_the_line_to_finish():
    from contbatch.jobs.runner import _StopSignal

    stop = _StopSignal()
    stop._handle(signal.SIGINT, None)
    assert stop.requested
    written = []
    with pytest.raises(KeyboardInterrupt):
        with stop.writing():
            stop._handle(signal.SIGINT, None)  # arrives mid-write: deferred
            written.append("the rest of the line")
    assert written == ["the rest of the line"]
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)  # outside a write: at once
