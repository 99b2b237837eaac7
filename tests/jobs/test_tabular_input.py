"""Parquet and CSV input: the same records as JSONL give the same results (ids, fingerprints,
texts); CSV quoting, BOM and JSON cells; Parquet structs and lists; a missing or mistyped
column refused before any work; bad rows reported with their row number; pyarrow optional."""

import json
import logging
import sys

import pytest

from contbatch.jobs import JobError
from contbatch.jobs.pyarrow_required import MissingDependency
from tests.jobs.helpers import (
    prompt_records,
    read_jsonl,
    results_by_id,
    write_csv,
    write_input,
    write_jsonl,
    write_parquet,
)

TABLES = ["csv", "parquet"]


@pytest.mark.parametrize("table", TABLES)
def test_table_gives_the_results_of_the_same_jsonl_records(run, tmp_path, table):
    records = prompt_records(12)  # string ids; every third row overrides max_tokens
    run(write_jsonl(tmp_path / "in.jsonl", records), output="from_jsonl.jsonl")
    summary = run(write_input(tmp_path / f"in.{table}", records), output="from_table.jsonl")
    assert (summary.status, summary.written, summary.errors) == ("done", 12, 0)
    # Equal fingerprints mean equal prompts and overrides, as read; equal outputs, the same generation.
    assert results_by_id(tmp_path / "from_table.jsonl") == results_by_id(tmp_path / "from_jsonl.jsonl")
    assert len({r["completion_tokens"] for r in read_jsonl(tmp_path / "from_table.jsonl")}) > 1, "overrides unused"


@pytest.mark.parametrize("table", TABLES)
def test_without_an_id_column_the_ids_are_row_numbers(run, tmp_path, table):
    records = [{"prompt": f"prompt {index}"} for index in range(4)]
    run(write_jsonl(tmp_path / "in.jsonl", records), output="from_jsonl.jsonl")
    run(write_input(tmp_path / f"in.{table}", records), output="from_table.jsonl")
    assert sorted(results_by_id(tmp_path / "from_table.jsonl")) == [1, 2, 3, 4]
    assert results_by_id(tmp_path / "from_table.jsonl") == results_by_id(tmp_path / "from_jsonl.jsonl")


def test_csv_quoting_bom_and_blank_lines(run, tmp_path):
    records = [
        {"id": "multi", "prompt": 'Line one,\nline "two"\r\nand three'},
        {"id": "plain", "prompt": "The capital of France is", "sampling_params": {"max_tokens": 2}},
        {"id": "unicode", "prompt": "Ünïcödé — ok? ✓"},
    ]
    run(write_jsonl(tmp_path / "in.jsonl", records), output="from_jsonl.jsonl")
    source = write_csv(tmp_path / "in.csv", records, encoding="utf-8-sig")  # a BOM, as spreadsheets write
    assert source.read_bytes().startswith(b"\xef\xbb\xbfid,")
    source.write_bytes(source.read_bytes() + b"\r\n\r\n")  # blank lines at the end
    summary = run(source, output="from_csv.jsonl")
    assert (summary.written, summary.errors) == (3, 0)
    assert results_by_id(tmp_path / "from_csv.jsonl") == results_by_id(tmp_path / "from_jsonl.jsonl")
    assert results_by_id(tmp_path / "from_csv.jsonl")["plain"]["completion_tokens"] <= 2


@pytest.mark.parametrize("table", TABLES)
def test_messages_column_applies_the_chat_template(run, tmp_path, table):
    records = [{"id": f"c{index}", "messages": [{"role": "user", "content": f"hello number {index}"}]}
               for index in range(3)]
    run(write_jsonl(tmp_path / "in.jsonl", records), output="from_jsonl.jsonl", messages_field="messages")
    summary = run(write_input(tmp_path / f"in.{table}", records), output="from_table.jsonl",
                  messages_field="messages")
    assert (summary.written, summary.errors) == (3, 0)
    assert results_by_id(tmp_path / "from_table.jsonl") == results_by_id(tmp_path / "from_jsonl.jsonl")


def test_parquet_struct_overrides_lose_their_null_fields(run, tmp_path):
    # One struct column for all rows: each row gets the other rows' fields as nulls.
    records = [{"id": "a", "prompt": "x", "sampling_params": {"max_tokens": 2}},
               {"id": "b", "prompt": "y", "sampling_params": {"min_tokens": 3, "max_tokens": 3}},
               {"id": "c", "prompt": "z"}]
    run(write_jsonl(tmp_path / "in.jsonl", records), output="from_jsonl.jsonl")
    summary = run(write_parquet(tmp_path / "in.parquet", records), output="from_parquet.jsonl")
    assert summary.errors == 0
    assert results_by_id(tmp_path / "from_parquet.jsonl") == results_by_id(tmp_path / "from_jsonl.jsonl")


@pytest.mark.parametrize("table", TABLES)
def test_only_the_used_columns_are_read(run, tmp_path, table, caplog):
    # Metadata columns are left alone, even one named like a sampling field or of a type no role takes.
    metadata = {"max_tokens": 1, "notes": "n/a"} | ({"blob": b"\x00\xff"} if table == "parquet" else {})
    run(write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}]), output="plain.jsonl")
    with caplog.at_level(logging.WARNING, logger="contbatch.jobs"):
        summary = run(write_input(tmp_path / f"in.{table}", [{"id": "a", "prompt": "x"} | metadata]))
    assert (summary.written, summary.errors) == (1, 0)
    assert results_by_id(tmp_path / "out.jsonl") == results_by_id(tmp_path / "plain.jsonl")
    assert "named like sampling parameters" not in caplog.text


@pytest.mark.parametrize("table", TABLES)
def test_missing_prompt_column_is_refused_before_any_work(run, tmp_path, table, no_model_load):
    source = write_input(tmp_path / f"in.{table}", [{"id": "a", "question": "x", "notes": "y"}])
    with pytest.raises(ValueError) as refused:
        run(source, llm=None)
    message = str(refused.value)
    assert "no column 'prompt'" in message and "'id', 'question', 'notes'" in message
    assert "--prompt-field" in message
    with pytest.raises(ValueError, match="no column 'chat'.*--messages-field"):
        run(source, llm=None, messages_field="chat")
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"in.{table}"]


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"prompt": 7}], "column 'prompt' has type int64; the prompt column must hold strings"),
        ([{"prompt": "x", "id": 1.5}], "column 'id' has type double; the id column must hold integers or strings"),
        ([{"prompt": "x", "sampling_params": [1]}], "the sampling column must hold structs"),
        ([{"prompt": "x", "lora_path": 3}], "column 'lora_path' has type int64; the adapter column must hold strings"),
    ],
)
def test_parquet_column_of_an_unusable_type_is_refused(run, tmp_path, records, message, no_model_load):
    with pytest.raises(ValueError, match=message):
        run(write_parquet(tmp_path / "in.parquet", records), llm=None)


def test_not_a_parquet_file_is_refused(run, tmp_path, no_model_load):
    source = tmp_path / "in.parquet"
    source.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="is not a readable Parquet file"):
        run(source, llm=None)


def test_bad_csv_rows_are_reported_with_their_row_number(run, tmp_path, caplog):
    source = tmp_path / "in.csv"
    source.write_bytes(
        b"id,prompt,sampling_params\n"
        b"a,fine,\n"                                     # row 1
        b"b,too,many,cells\n"                            # row 2
        b'c,x,"{""max_tokens"": 2"\n'                    # row 3: JSON cut off
        b"d,   ,\n"                                      # row 4
        b'a,again,\n'                                    # row 5
        b",no id,\n"                                     # row 6
        b"e,\xff\xfe not UTF-8,\n"                       # row 7
        b'f,x,"{""temprature"": 0.5}"\n'                 # row 8
        b"g,also fine,\n"                                # row 9
    )
    with caplog.at_level(logging.WARNING, logger="contbatch.jobs"):
        summary = run(source)
    assert (summary.written, summary.errors) == (2, 7)
    assert sorted(results_by_id(tmp_path / "out.jsonl")) == ["a", "g"]
    errors = {error["line"]: error for error in read_jsonl(summary.errors_path)}
    expected = {2: "row has 4 cells, the header has 3 columns", 3: "column 'sampling_params' is not valid JSON",
                4: "empty prompt", 5: "duplicate id 'a': an earlier row has it",
                6: "'id' must be a non-empty string or an integer, got None", 7: "column 'prompt' is not valid UTF-8",
                8: "unknown sampling parameter"}
    assert sorted(errors) == sorted(expected)
    for row, message in expected.items():
        assert message in errors[row]["error"], (row, errors[row])
        assert f"in.csv row {row}: " in caplog.text
    assert errors[3]["id"] == "c" and errors[2]["id"] is None


def test_bad_parquet_rows_are_reported_under_stop(run, tmp_path):
    records = [{"id": "a", "prompt": "fine", "sampling_params": None},
               {"id": "b", "prompt": None, "sampling_params": None},
               {"id": None, "prompt": "x", "sampling_params": None},
               {"id": "d", "prompt": "x", "sampling_params": '{"max_tokens": 0}'}]
    with pytest.raises(JobError) as refused:
        run(write_parquet(tmp_path / "in.parquet", records), on_error="stop")
    message = str(refused.value)
    assert "3 bad record(s)" in message and "nothing was generated" in message
    assert "row 2: field 'prompt' must be a string" in message
    assert "row 3: 'id' must be a non-empty string or an integer, got None" in message
    assert "row 4: SamplingParams.max_tokens must be None or >= 1" in message
    assert not (tmp_path / "out.jsonl").exists()


def test_unknown_format_flag_is_a_usage_error(tmp_path, chat_model_dir, capsys):
    from contbatch.cli import main

    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with pytest.raises(SystemExit) as exited:
        main(["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--format", "xlsx"])
    assert exited.value.code == 2 and "invalid choice: 'xlsx'" in capsys.readouterr().err


@pytest.fixture
def without_pyarrow(monkeypatch):
    """pyarrow cannot be imported, as where contbatch[parquet] is not installed."""
    for name in [name for name in sys.modules if name == "pyarrow" or name.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)


@pytest.mark.parametrize("input_name, output_name", [("in.parquet", "out.jsonl"), ("in.jsonl", "out.parquet")])
def test_parquet_without_pyarrow_is_refused_before_any_work(
    run, tmp_path, input_name, output_name, without_pyarrow, no_model_load
):
    source = tmp_path / input_name
    source.write_bytes(b"not read\n")
    with pytest.raises(MissingDependency, match=r"pip install contbatch\[parquet\]"):
        run(source, output_name, llm=None)
    assert sorted(path.name for path in tmp_path.iterdir()) == [input_name]


def test_csv_and_jsonl_need_no_pyarrow(run, tmp_path, without_pyarrow):
    summary = run(write_csv(tmp_path / "in.csv", [{"id": "a", "prompt": "x"}]))
    assert summary.written == 1 and json.loads((tmp_path / "out.jsonl").read_text())["id"] == "a"


@pytest.mark.parametrize("suffix", ["txt", "jsonl"])
def test_a_leading_bom_in_a_line_file_is_dropped(run, tmp_path, suffix):
    """Text and JSONL saved with a UTF-8 BOM: the first record is the same as without it."""
    lines = ["The capital of France is", "Water boils at"]
    if suffix == "jsonl":
        lines = [json.dumps({"prompt": line}) for line in lines]
    plain, marked = tmp_path / f"plain.{suffix}", tmp_path / f"marked.{suffix}"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    marked.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    run(plain, output="from_plain.jsonl")
    summary = run(marked, output="from_marked.jsonl")
    assert (summary.written, summary.errors) == (2, 0)
    assert results_by_id(tmp_path / "from_marked.jsonl") == results_by_id(tmp_path / "from_plain.jsonl")


def test_messages_with_text_parts_are_the_same_as_strings(run, tmp_path):
    """A record's messages may use OpenAI-style text parts, as chat() takes them; other parts
    make a bad record that names them."""
    plain = [{"id": "a", "messages": [{"role": "user", "content": "Name a colour.\nOne word."}]}]
    parts = [{"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                                                   {"type": "text", "text": "One word."}]}]},
             {"id": "b", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}]
    run(write_jsonl(tmp_path / "plain.jsonl", plain), output="from_plain.jsonl", messages_field="messages")
    summary = run(write_jsonl(tmp_path / "parts.jsonl", parts), output="from_parts.jsonl", messages_field="messages")
    assert (summary.written, summary.errors) == (1, 1)
    assert results_by_id(tmp_path / "from_parts.jsonl")["a"]["outputs"] == results_by_id(tmp_path / "from_plain.jsonl")["a"]["outputs"]
    (error,) = read_jsonl(tmp_path / "from_parts.jsonl.errors.jsonl")
    assert error["id"] == "b" and "content part 0" in error["error"] and "'image_url'" in error["error"]
