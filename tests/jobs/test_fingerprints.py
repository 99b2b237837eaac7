"""Resuming onto a changed input: an inserted line, an edited prompt or sampling override, or
another input file is refused before the model loads, naming the first changed id; with
redo_mismatched those records are generated again, one result per id."""

import pytest

from contbatch.jobs import InputMismatch, OutputError
from contbatch.jobs.output import ResultWriter
from tests.jobs.helpers import prompt_records, read_jsonl, results_by_id, write_jsonl

CAPITALS = ["The capital of France is", "The capital of Italy is", "The capital of Germany is"]
INSERTED = ["The capital of Spain is", *CAPITALS]


def _write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_inserted_line_is_refused_before_the_model_loads(run, tmp_path, no_model_load):
    source = _write_lines(tmp_path / "in.txt", CAPITALS)
    assert run(source).written == 3  # llm given: no_model_load only stops a job that builds one
    before = (tmp_path / "out.jsonl").read_bytes()
    _write_lines(source, INSERTED)
    with pytest.raises(InputMismatch) as refused:
        run(source, llm=None)
    message = str(refused.value)
    assert "3 existing result(s)" in message and "first: id 1 at input line 1: the prompt differs" in message
    assert "--redo-mismatched" in message
    assert (tmp_path / "out.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "field, value, what",
    [("prompt", "A different question", "the prompt differs"),
     ("sampling_params", {"max_tokens": 2}, "the sampling settings or LoRA adapter differ")],
)
def test_edited_record_under_the_same_id_is_refused(run, tmp_path, field, value, what):
    records = prompt_records(6)  # q3 overrides max_tokens (4)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    run(source)
    records[3][field] = value
    write_jsonl(source, records)
    with pytest.raises(InputMismatch, match=f"1 existing result.*first: id 'q3' at input line 4: {what}"):
        run(source)


def test_another_input_file_is_refused_and_a_copy_is_not(run, tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": text} for text in CAPITALS])  # ids: line numbers
    other = write_jsonl(tmp_path / "b.jsonl", [{"prompt": text} for text in ("Two plus two is", "The sky is")])
    run(first)
    with pytest.raises(InputMismatch, match="first: id 1 at input line 1: the prompt differs"):
        run(other)
    # The same records elsewhere, with a metadata key added, are the same job.
    copy = write_jsonl(tmp_path / "c.jsonl", [{"prompt": text, "source": "copy"} for text in CAPITALS])
    summary = run(copy)
    assert (summary.written, summary.already_done) == (0, 3)


def test_redo_mismatched_replaces_the_stale_results(run, tmp_path):
    source = _write_lines(tmp_path / "in.txt", CAPITALS)
    run(source)
    _write_lines(source, INSERTED)
    summary = run(source, redo_mismatched=True)
    assert (summary.written, summary.already_done, summary.redone) == (4, 0, 3)
    run(source, output="fresh.jsonl")
    assert results_by_id(tmp_path / "out.jsonl") == results_by_id(tmp_path / "fresh.jsonl")
    assert run(source).written == 0  # and a plain rerun resumes cleanly


def test_redo_mismatched_keeps_the_results_that_still_match(run, tmp_path):
    records = prompt_records(12)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    run(source)
    records[2]["prompt"] = "An edited question"
    records[7]["sampling_params"] = {"max_tokens": 1}
    write_jsonl(source, records)
    summary = run(source, redo_mismatched=True)
    assert (summary.written, summary.already_done, summary.redone) == (2, 10, 2)
    run(source, output="fresh.jsonl")
    assert results_by_id(tmp_path / "out.jsonl") == results_by_id(tmp_path / "fresh.jsonl")


def test_results_without_a_fingerprint_need_a_flag(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", prompt_records(5))
    output = tmp_path / "out.jsonl"
    run(source)
    legacy = [{key: value for key, value in r.items() if key != "fingerprint"} for r in read_jsonl(output)]
    write_jsonl(output, legacy)  # as an older contbatch wrote them
    with pytest.raises(InputMismatch, match="5 existing result.*no fingerprint.*--redo-mismatched.*--force"):
        run(source)
    assert run(source, force=True).already_done == 5 and read_jsonl(output) == legacy
    summary = run(source, redo_mismatched=True)
    assert (summary.written, summary.redone) == (5, 5)
    assert all("fingerprint" in r for r in read_jsonl(output))


def test_dropping_results_rewrites_the_file_and_keeps_it_locked(tmp_path):
    path = write_jsonl(tmp_path / "out.jsonl", [{"id": index, "outputs": []} for index in range(4)])
    writer = ResultWriter(path)
    try:
        writer.drop({1, 2})
        assert [r["id"] for r in read_jsonl(path)] == [0, 3] and set(writer.done) == {0, 3}
        with pytest.raises(OutputError, match="another running job"):
            ResultWriter(path)
        writer.write({"id": 5, "outputs": []})
    finally:
        writer.close()
    assert [r["id"] for r in read_jsonl(path)] == [0, 3, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
