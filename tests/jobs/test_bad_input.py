"""Bad input records under on_error="skip" (listed, the rest runs) and "stop" (refused up front)."""

import json
import logging

import pytest

from contbatch import SamplingParams
from contbatch.jobs import JobError, run_job
from tests.jobs.helpers import read_jsonl, write_jsonl

BAD_LINES = [
    ('{"id": "a", "prompt": "fine"}', None),
    ('{"id": "b", "prompt": "cut off', "malformed JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"id": "c"}', "missing field 'prompt'"),
    ('{"id": "a", "prompt": "again"}', "duplicate id 'a'"),
    ('{"id": "d", "prompt": "   "}', "empty prompt"),
    ('{"id": "e", "prompt": 42}', "must be a string"),
    ('{"id": 1.5, "prompt": "x"}', "must be a non-empty string or an integer"),
    ('{"id": "f", "prompt": "x", "sampling_params": {"max_tokens": 0}}', "max_tokens must be None or >= 1"),
    ('{"id": "g", "prompt": "x", "sampling_params": {"temprature": 0.5}}', "unknown sampling parameter"),
    ('{"id": "h", "prompt": "' + "word " * 300 + '"}', "max_model_len"),  # only the engine can tell
    ('{"id": "i", "prompt": "also fine"}', None),
]


@pytest.fixture
def bad_input(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [line for line, _ in BAD_LINES])


def test_skip_lists_every_bad_record_with_its_line_and_runs_the_rest(bad_input, run, tmp_path, caplog):
    output = tmp_path / "out.jsonl"
    summary = run(bad_input)
    assert summary.status == "done" and summary.written == 2
    assert {r["id"] for r in read_jsonl(output)} == {"a", "i"}
    errors = {e["line"]: e for e in read_jsonl(summary.errors_path)}
    expected = {number: message for number, (_, message) in enumerate(BAD_LINES, start=1) if message}
    assert sorted(errors) == sorted(expected)
    for number, message in expected.items():
        assert message in errors[number]["error"], (number, errors[number])
        assert f"line {number}: " in caplog.text
    assert errors[5]["id"] == "a" and errors[2]["id"] is None
    # A rerun redoes the bad records (still bad) and rewrites the errors file, not appends to it.
    again = run(bad_input)
    assert again.written == 0 and again.errors == len(expected) == len(read_jsonl(again.errors_path))


def test_stop_refuses_before_any_work(bad_input, run, tmp_path):
    output = tmp_path / "out.jsonl"
    with pytest.raises(JobError) as refused:
        run(bad_input, on_error="stop")
    message = str(refused.value)
    assert "9 bad record(s)" in message and "nothing was generated" in message
    for number in (2, 3, 4, 5, 6, 7, 8, 9, 10):
        assert f"line {number}: " in message
    assert not output.exists() and not (tmp_path / "out.jsonl.meta.json").exists()
    assert len(read_jsonl(tmp_path / "out.jsonl.errors.jsonl")) == 9


def test_stop_halts_on_an_error_only_the_engine_finds(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}, {"prompt": "word " * 300}, {"prompt": "later"}])
    summary = run(source, on_error="stop")
    assert summary.status == "stopped" and summary.errors == 1
    assert "fix the bad record" in summary.line()


def test_text_input_uses_line_numbers_as_ids_and_skips_blank_lines(run, tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("first prompt\n\nsecond prompt\r\n   \nthird prompt")
    summary = run(source)
    assert summary.written == 3 and summary.errors == 0
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == [1, 3, 5]


def test_only_sampling_params_overrides_sampling(run, tmp_path, caplog):
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "metadata", "prompt": "x", "max_tokens": 2, "n": 3},  # metadata named like sampling fields
        {"id": "nested", "prompt": "x", "max_tokens": 2, "sampling_params": {"max_tokens": 3}},
        {"id": "default", "prompt": "x"},
        {"id": "choice", "prompt": "Yes or no?",
         "sampling_params": {"structured_outputs": {"choice": ["yes", "no"]}, "ignore_eos": False}},
    ])
    with caplog.at_level(logging.WARNING, logger="contbatch.jobs"):
        run(source, sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    results = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert {k: r["completion_tokens"] for k, r in results.items() if k != "choice"} == {
        "metadata": 5, "nested": 3, "default": 5}
    assert len(results["metadata"]["outputs"]) == 1, "a top-level 'n' must not change sampling"
    assert results["choice"]["outputs"][0]["text"] in ("yes", "no")
    warnings = [r.getMessage() for r in caplog.records if "named like sampling parameters" in r.getMessage()]
    assert len(warnings) == 1 and "['max_tokens', 'n']" in warnings[0]


def test_records_may_restrict_their_tokens(run, tmp_path, chat_llm):
    """JSON object keys are strings: a record's logit_bias names its tokens by decimal strings."""
    tokenizer = chat_llm.get_tokenizer()
    yes, cat = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " cat"))
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "bias", "prompt": "x", "sampling_params": {"logit_bias": {str(yes): 100}}},
        {"id": "allowed", "prompt": "x", "sampling_params": {"allowed_token_ids": [cat], "temperature": 1.0}},
        {"id": "bad", "prompt": "x", "sampling_params": {"logit_bias": {str(yes): 100}, "bad_words": ["yes"]}},
        {"id": "wrong", "prompt": "x", "sampling_params": {"logit_bias": {"yes": 1}}},
    ])
    summary = run(source, sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    texts = {r["id"]: r["outputs"][0]["text"] for r in read_jsonl(tmp_path / "out.jsonl")}
    assert texts["bias"] == " yes yes yes" and texts["allowed"] == " cat cat cat"
    assert "yes" not in texts["bad"]
    assert summary.errors == 1 and "logit_bias must be keyed by token ids" in read_jsonl(summary.errors_path)[0]["error"]


def test_messages_field_applies_the_chat_template(run, tmp_path, chat_llm):
    messages = [{"role": "user", "content": "hi there"}]
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "messages": messages}, {"id": 2, "messages": []}])
    summary = run(source, messages_field="messages")
    (record,) = read_jsonl(tmp_path / "out.jsonl")
    tokenizer = chat_llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert record["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert summary.errors == 1 and "non-empty list" in read_jsonl(summary.errors_path)[0]["error"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(on_error="maybe"), "on_error must be"),
        (dict(input_format="xlsx"), "input_format must be"),
        (dict(output_format="csv"), "output_format must be"),
        (dict(prompt_field="text", messages_field="messages"), "not both"),
    ],
)
def test_bad_arguments(run, tmp_path, kwargs, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match=message):
        run(source, **kwargs)


def test_unknown_extension_needs_a_format(run, tmp_path):
    source = tmp_path / "prompts.data"
    source.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        run(source)
    assert run(source, input_format="jsonl").written == 1


def test_job_sampling_params_may_be_a_dict_of_fields_and_nothing_else(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    summary = run(source, sampling_params={"temperature": 0, "max_tokens": 2, "ignore_eos": True})
    assert summary.status == "done" and read_jsonl(tmp_path / "out.jsonl")[0]["completion_tokens"] == 2
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a dict of its fields or None, got list"):
        run(source, output="other.jsonl", sampling_params=[SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens"):
        run(source, output="other.jsonl", sampling_params={"max_tokens": 0})


def test_an_input_that_is_not_a_file_is_named_as_such(tmp_path, no_model_load):
    (tmp_path / "folder").mkdir()
    for name, reason in (("folder", "is a directory, not a file"), ("absent.jsonl", "does not exist")):
        with pytest.raises(JobError, match=f"input file '.*{name}' {reason}"):
            run_job(tmp_path / name, tmp_path / "out.jsonl", llm=None)


def test_an_empty_string_id_is_a_bad_record_in_jsonl_as_in_tables(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "", "prompt": "x"}, {"id": "ok", "prompt": "y"}])
    summary = run(source)
    assert (summary.written, summary.errors) == (1, 1)
    (error,) = read_jsonl(summary.errors_path)
    assert error["line"] == 1 and "'id' must be a non-empty string or an integer, got ''" in error["error"]


@pytest.mark.parametrize(("every", "interval"), [(0, 5.0), (10, -1.0), (10, float("nan"))])
def test_fsync_settings_out_of_range_are_refused_before_the_model_loads(tmp_path, no_model_load, every, interval):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="fsync_every must be >= 1 and fsync_interval >= 0"):
        run_job(source, tmp_path / "out.jsonl", llm=None, fsync_every=every, fsync_interval=interval)
