"""Helpers for the bulk-job tests: input files, results, and the CLI as a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as source:
        return [json.loads(line) for line in source]


def prompt_records(count: int) -> list[dict]:
    """Varied prompts; every third line overrides max_tokens so requests finish out of order."""
    records = []
    for index in range(count):
        record = {"id": f"q{index}", "prompt": f"Question {index}: " + "tell me more " * (index % 7)}
        if index % 3 == 0:
            record["sampling_params"] = {"max_tokens": 1 + index % 11}
        records.append(record)
    return records


def cli_command(input_path: Path, output_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "contbatch", "generate", "--input", str(input_path), "--output", str(output_path),
        "--model", str(model_dir), "--dtype", "float32", "--temperature", "0", "--max-tokens", "8", *extra,
    ]


def cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_cli(command: list[str]) -> subprocess.Popen:
    """``command`` (the CLI, or a Python child that imports contbatch) in the background, its output piped."""
    return subprocess.Popen(command, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
