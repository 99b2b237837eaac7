"""Where results go: standard output with ``-o -`` (no resume, nothing beside it), output
paths that are not regular files refused before the model loads, and run_job's ``on_result``
hook called after each line is written. The command line runs as a subprocess, its stdout a
pipe, with a timeout so that a hang fails."""

import json
import subprocess
from pathlib import Path

import pytest

from contbatch.jobs import OutputError
from tests.jobs.helpers import cli_command, cli_env, read_jsonl, write_jsonl

TIMEOUT_S = 120


@pytest.fixture
def source(tmp_path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"id": index, "prompt": f"prompt {index}"} for index in range(3)])


def _cli(command: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=cli_env(), text=True, timeout=TIMEOUT_S, **kwargs)


def test_dash_writes_the_results_to_a_pipe_and_nothing_beside(source, tmp_path, chat_model_dir):
    finished = _cli(cli_command(source, Path("-"), chat_model_dir), tmp_path, capture_output=True)
    assert finished.returncode == 0, finished.stderr
    results = [json.loads(line) for line in finished.stdout.splitlines()]
    assert sorted(r["id"] for r in results) == [0, 1, 2]
    assert all(len(r["outputs"]) == 1 and r["completion_tokens"] > 0 for r in results)
    assert "3 records written to standard output" in finished.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no results, meta or errors file


def test_dev_stdout_on_a_pipe_is_refused_at_once(source, tmp_path, chat_model_dir):
    finished = _cli(cli_command(source, Path("/dev/stdout"), chat_model_dir), tmp_path, capture_output=True)
    assert finished.returncode == 1 and finished.stdout == ""
    assert "is a pipe" in finished.stderr and "'-'" in finished.stderr


def test_dev_stdout_redirected_to_a_file_is_refused(source, tmp_path, chat_model_dir):
    with open(tmp_path / "redirected.jsonl", "w") as redirected:
        finished = _cli(cli_command(source, Path("/dev/stdout"), chat_model_dir), tmp_path, stdout=redirected,
                        stderr=subprocess.PIPE)
    assert finished.returncode == 1 and "cannot hold a results file" in finished.stderr
    assert (tmp_path / "redirected.jsonl").read_text() == ""


def test_a_directory_output_is_refused_before_the_model_loads(run, source, tmp_path, no_model_load):
    (tmp_path / "out.jsonl").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        run(source, llm=None)


def test_on_result_gets_each_result_after_its_line_is_written(run, source, tmp_path):
    output = tmp_path / "out.jsonl"
    seen = []
    run(source, on_result=lambda result: seen.append((result, output.read_bytes().count(b"\n"))))
    assert [result for result, _ in seen] == read_jsonl(output)
    assert [lines for _, lines in seen] == [1, 2, 3]
