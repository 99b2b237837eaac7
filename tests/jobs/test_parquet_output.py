"""Parquet output: the JSONL results in input order with typed columns, written from the journal
once the job is done; a rerun of a finished job leaves the file as it is; an interrupted or
failed write leaves the previous file; a resume adds to the journal and rewrites the file.
(SIGKILLs at any moment, with the command line: test_crash.py.)"""

import hashlib
import json
import os

import pyarrow
import pyarrow.parquet
import pytest

from contbatch import SamplingParams
from contbatch.cli import main
from contbatch.jobs import OutputError, run_job
from contbatch.jobs.parquet_output import JOURNAL_DIGEST_KEY
from tests.jobs.helpers import prompt_records, read_jsonl, read_parquet, results_by_id, write_input, write_jsonl


def _in_input_order(records: list[dict], results_path) -> list[dict]:
    by_id = results_by_id(results_path)
    return [by_id[record["id"]] for record in records if record["id"] in by_id]


@pytest.mark.parametrize("input_name", ["in.jsonl", "in.csv", "in.parquet"])
def test_parquet_holds_the_jsonl_results_in_input_order(run, tmp_path, input_name):
    records = prompt_records(30)  # every third overrides max_tokens: results finish out of order
    source = write_input(tmp_path / input_name, records)
    run(source, output="out.jsonl")
    summary = run(source, output="out.parquet")
    assert (summary.status, summary.written, summary.journal) == ("done", 30, tmp_path / "out.parquet.journal.jsonl")
    rows = read_parquet(tmp_path / "out.parquet")
    assert rows == _in_input_order(records, tmp_path / "out.jsonl")
    assert [r["id"] for r in read_jsonl(summary.journal)] != [r["id"] for r in rows], "the journal was in order"
    assert "records written to " + str(tmp_path / "out.parquet") in summary.line()


def test_columns_are_typed(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 7, "prompt": "x"}, {"id": 8, "prompt": "y"}])
    run(source, output="out.parquet", sampling_params=SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    schema = pyarrow.parquet.read_schema(tmp_path / "out.parquet")
    completion = schema.field("outputs").type.value_type
    assert schema.field("id").type == pyarrow.int64()
    assert [completion.field(i).name for i in range(completion.num_fields)] == [
        "text", "finish_reason", "stop_reason", "completion_tokens", "logprobs", "cumulative_logprob"]
    assert completion.field("completion_tokens").type == pyarrow.int64()
    assert completion.field("logprobs").type.value_type.key_type == pyarrow.int64()
    assert str(schema.field("fingerprint").type) == "struct<prompt: string, sampling: string>"
    parquet_logprobs = read_parquet(tmp_path / "out.parquet")[0]["outputs"][0]["logprobs"]
    jsonl_logprobs = read_jsonl(tmp_path / "out.parquet.journal.jsonl")[0]["outputs"][0]["logprobs"]
    assert len(parquet_logprobs) == 3
    assert [{str(token): value for token, value in position} for position in parquet_logprobs] == jsonl_logprobs


def test_ids_of_mixed_types_are_strings(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "y"}])  # "a" and line 2
    run(source, output="out.parquet")
    assert [row["id"] for row in read_parquet(tmp_path / "out.parquet")] == ["a", "2"]


def test_rerun_of_a_finished_job_leaves_the_file_as_it_is(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", prompt_records(10))
    run(source, output="out.parquet")
    output = tmp_path / "out.parquet"
    before = (output.read_bytes(), os.stat(output).st_mtime_ns, os.stat(output).st_ino)
    summary = run(source, output="out.parquet")
    assert (summary.status, summary.written, summary.already_done) == ("done", 0, 10)
    assert (output.read_bytes(), os.stat(output).st_mtime_ns, os.stat(output).st_ino) == before
    journal = tmp_path / "out.parquet.journal.jsonl"
    assert pyarrow.parquet.read_schema(output).metadata[JOURNAL_DIGEST_KEY].decode() == _sha256(journal)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_resume_adds_to_the_journal_and_rewrites_the_file(run, tmp_path):
    records = prompt_records(12)
    source = write_jsonl(tmp_path / "in.jsonl", records[:5])
    run(source, output="out.parquet")
    assert len(read_parquet(tmp_path / "out.parquet")) == 5
    write_jsonl(source, records)  # more records: the job is no longer done
    summary = run(source, output="out.parquet")
    assert (summary.written, summary.already_done) == (7, 5)
    run(source, output="reference.jsonl")
    assert read_parquet(tmp_path / "out.parquet") == _in_input_order(records, tmp_path / "reference.jsonl")


def test_a_killed_run_resumes_from_the_journal(run, tmp_path):
    records = prompt_records(12)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    run(source, output="reference.jsonl")
    run(source, output="out.parquet")
    journal, output = tmp_path / "out.parquet.journal.jsonl", tmp_path / "out.parquet"
    data = journal.read_bytes()
    journal.write_bytes(data[: data.index(b"\n", len(data) // 2) + 20])  # killed mid-line, half-way
    output.unlink()  # ... before the Parquet file was first written
    summary = run(source, output="out.parquet")
    assert summary.status == "done" and 0 < summary.written < 12
    assert read_parquet(output) == _in_input_order(records, tmp_path / "reference.jsonl")


def test_a_job_that_stops_writes_no_parquet_file(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}, {"prompt": "word " * 300}, {"prompt": "later"}])
    summary = run(source, output="out.parquet", on_error="stop")
    assert summary.status == "stopped" and not (tmp_path / "out.parquet").exists()
    assert summary.written == len(read_jsonl(tmp_path / "out.parquet.journal.jsonl"))
    assert "out.parquet is written once every record is done" in summary.line()


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(run, tmp_path, monkeypatch):
    records = prompt_records(8)
    source = write_jsonl(tmp_path / "in.jsonl", records[:4])
    run(source, output="out.parquet")
    before = (tmp_path / "out.parquet").read_bytes()
    write_jsonl(source, records)

    def killed(*args):
        raise KeyboardInterrupt  # as Ctrl-C while the file is renamed

    monkeypatch.setattr("contbatch.jobs.parquet_output.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run(source, output="out.parquet")
    monkeypatch.undo()
    assert (tmp_path / "out.parquet").read_bytes() == before
    assert not (tmp_path / "out.parquet.tmp").exists()
    summary = run(source, output="out.parquet")
    assert (summary.written, summary.already_done) == (0, 8)
    assert [row["id"] for row in read_parquet(tmp_path / "out.parquet")] == [r["id"] for r in records]


def test_output_format_overrides_the_extension(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    run(source, output="results.data", output_format="parquet")
    assert [row["id"] for row in read_parquet(tmp_path / "results.data")] == ["a"]
    run(source, output="plain.parquet", output_format="jsonl")
    assert json.loads((tmp_path / "plain.parquet").read_text())["id"] == "a"
    with pytest.raises(ValueError, match="Parquet output needs a file"):
        run_job(source, "-", output_format="parquet")


def test_an_existing_file_that_is_not_a_results_file_is_refused(run, tmp_path, no_model_load):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    other_data = write_input(tmp_path / "data.parquet", [{"id": "a", "prompt": "x"}])
    before = other_data.read_bytes()
    with pytest.raises(OutputError, match="is not a Parquet results file written by contbatch"):
        run(source, output="data.parquet", llm=None)
    assert other_data.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data.parquet", "in.jsonl"]


def test_cli_writes_parquet(tmp_path, chat_model_dir, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": index, "prompt": f"prompt {index}"} for index in range(3)])
    arguments = ["generate", "-i", str(source), "-o", str(tmp_path / "out.data"), "-m", str(chat_model_dir),
                 "--dtype", "float32", "--temperature", "0", "--max-tokens", "3", "--output-format", "parquet"]
    assert main(arguments) == 0
    assert "done: 3 records written to" in capsys.readouterr().err
    assert [row["id"] for row in read_parquet(tmp_path / "out.data")] == [0, 1, 2]


def test_prompt_logprobs_are_written_where_records_ask_for_them(run, tmp_path, chat_llm):
    """A record's sampling_params.prompt_logprobs (or the job's) puts the prompt's logprobs in
    its result, as generate() returns them; the Parquet column holds the same, null elsewhere."""
    records = [{"id": "asks", "prompt": "The sky is", "sampling_params": {"prompt_logprobs": 2}},
               {"id": "plain", "prompt": "The sea is"}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    run(source, output="out.parquet")
    journal = results_by_id(tmp_path / "out.parquet.journal.jsonl")
    assert "prompt_logprobs" not in journal["plain"]
    written = journal["asks"]["prompt_logprobs"]
    expected = chat_llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                 use_tqdm=False)[0].prompt_logprobs
    assert len(written) == journal["asks"]["prompt_tokens"] == len(expected) > 1 and written[0] is None
    for position, theirs in zip(written[1:], expected[1:]):
        assert {int(token): (v["logprob"], v["rank"], v["decoded_token"]) for token, v in position.items()} == {
            token: (v.logprob, v.rank, v.decoded_token) for token, v in theirs.items()}

    schema = pyarrow.parquet.read_schema(tmp_path / "out.parquet")
    assert schema.field("prompt_logprobs").type.value_type.key_type == pyarrow.int64()
    rows = {row["id"]: row for row in read_parquet(tmp_path / "out.parquet")}
    assert rows["plain"]["prompt_logprobs"] is None
    assert [None if p is None else {str(token): value for token, value in p} for p in rows["asks"]["prompt_logprobs"]] == written
