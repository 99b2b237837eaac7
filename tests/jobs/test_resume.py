"""Resuming a job: skipped ids, torn last lines, corrupt files, settings fingerprints, locking."""

import json

import pytest

from contbatch import SamplingParams
from contbatch.jobs import OutputError, SettingsMismatch, run_job
from contbatch.jobs.output import ResultWriter
from contbatch.jobs.settings import model_fingerprint
from tests.jobs.helpers import prompt_records, read_jsonl, write_jsonl

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture
def job(tmp_path, chat_model_dir, chat_llm):
    """run(**overrides) runs the same 40-record job into tmp_path/out.jsonl."""
    source = write_jsonl(tmp_path / "in.jsonl", prompt_records(40))
    output = tmp_path / "out.jsonl"

    def run(**overrides):
        kwargs = dict(model=chat_model_dir, llm=chat_llm, sampling_params=GREEDY) | overrides
        return run_job(source, output, **kwargs)

    return run, output


@pytest.fixture
def reference(job):
    """{id: record} of an uninterrupted run."""
    run, output = job
    summary = run()
    assert summary.status == "done" and summary.written == 40
    records = {r["id"]: r for r in read_jsonl(output)}
    for path in output.parent.glob("out.jsonl*"):
        path.unlink()
    return records


def test_resume_skips_written_ids_and_completes_the_rest(job, reference):
    run, output = job
    kept = list(reference.values())[:15]
    write_jsonl(output, kept)
    summary = run(force=True)  # no meta file yet: hand-made partial output
    assert (summary.status, summary.already_done, summary.written) == ("done", 15, 25)
    records = read_jsonl(output)
    assert len(records) == 40 and {r["id"]: r for r in records} == reference
    assert run().written == 0  # a finished job reruns as a no-op


def test_torn_last_line_is_cut_off_and_regenerated(job, reference, caplog):
    run, output = job
    run()
    data = output.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    torn_id = json.loads(data[last_start:])["id"]
    output.write_bytes(data[: last_start + 10])  # died 10 bytes into the last record
    summary = run()
    assert "cut off a torn last line" in caplog.text
    assert (summary.written, summary.already_done) == (1, 39)
    records = read_jsonl(output)
    assert records[-1]["id"] == torn_id and {r["id"]: r for r in records} == reference


def test_unparsable_last_line_counts_as_torn(job, reference):
    run, output = job
    run()
    with open(output, "ab") as out:
        out.write(b"\x00\x00\x00\x00\n")  # what a power loss can leave behind
    assert run().written == 0
    assert len(read_jsonl(output)) == 40


def test_corrupt_line_before_the_end_is_refused(job):
    run, output = job
    run()
    lines = output.read_bytes().splitlines(keepends=True)
    output.write_bytes(b"".join(lines[:3] + [b"{not json\n"] + lines[3:]))
    with pytest.raises(OutputError, match="line 4 is corrupt"):
        run()


def test_mismatched_sampling_is_refused_unless_forced(job):
    run, output = job
    write_jsonl(output.parent / "in.jsonl", prompt_records(40)[:10])
    run()
    write_jsonl(output.parent / "in.jsonl", prompt_records(40))
    with pytest.raises(SettingsMismatch, match=r"sampling\.max_tokens: 6 in the existing results, 7 now"):
        run(sampling_params=SamplingParams(temperature=0, max_tokens=7))
    assert len(read_jsonl(output)) == 10  # nothing touched
    summary = run(sampling_params=SamplingParams(temperature=0, max_tokens=7), force=True)
    assert summary.written == 30
    meta = json.loads((output.parent / "out.jsonl.meta.json").read_text())
    assert meta["settings"]["sampling.max_tokens"] == 7


def test_mismatched_prompt_field_is_refused(job):
    run, _ = job
    run()
    with pytest.raises(SettingsMismatch, match="prompt.prompt_field"):
        run(prompt_field="text")


def test_results_without_settings_file_are_refused(job):
    run, output = job
    write_jsonl(output, [{"id": "q0", "outputs": []}])
    with pytest.raises(SettingsMismatch, match="no settings file"):
        run()


def test_model_fingerprint_follows_config_and_weights(tmp_path, chat_model_dir):
    copy = tmp_path / "model"
    copy.mkdir()
    for path in chat_model_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "README.md").write_text("notes do not matter")
    assert model_fingerprint(copy) == model_fingerprint(chat_model_dir)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    assert model_fingerprint(copy) != model_fingerprint(chat_model_dir)


def test_a_second_writer_on_the_same_output_is_refused(tmp_path):
    first = ResultWriter(tmp_path / "out.jsonl")
    try:
        with pytest.raises(OutputError, match="another running job"):
            ResultWriter(tmp_path / "out.jsonl")
    finally:
        first.close()
