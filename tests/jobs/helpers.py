"""Helpers for the bulk-job tests: input files, results, and the CLI as a subprocess."""

import csv
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


def results_by_id(path: Path) -> dict:
    """{id: result} of a JSONL results file, which must hold one result per id."""
    records = read_jsonl(path)
    assert len({r["id"] for r in records}) == len(records), "an id has two results"
    return {r["id"]: r for r in records}


def write_csv(path: Path, records: list[dict], encoding: str = "utf-8") -> Path:
    """One row per record under a header of every key; objects and lists as JSON text, None as an empty cell."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    with open(path, "w", encoding=encoding, newline="") as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        for record in records:
            writer.writerow([_cell(record.get(column)) for column in columns])
    return path


def write_parquet(path: Path, records: list[dict], row_group_size: int = 64) -> Path:
    """The records as a Parquet table (nested values as structs and lists), in small row groups."""
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet

    return pyarrow.parquet.read_table(path).to_pylist()


def write_input(path: Path, records: list[dict]) -> Path:
    """The records in the format the path's extension names: .jsonl, .csv or .parquet."""
    writers = {".jsonl": write_jsonl, ".csv": write_csv, ".parquet": write_parquet}
    return writers[path.suffix](path, records)


def prompt_records(count: int) -> list[dict]:
    """Varied prompts; every third line overrides max_tokens so requests finish out of order."""
    records = []
    for index in range(count):
        record = {"id": f"q{index}", "prompt": f"Question {index}: " + "tell me more " * (index % 7)}
        if index % 3 == 0:
            record["sampling_params"] = {"max_tokens": 1 + index % 11}
        records.append(record)
    return records


def _cell(value: object) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


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
