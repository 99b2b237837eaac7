"""Reading a job's input file lazily, one record at a time, into records with ids.

JSONL: one JSON object per line; the id is the ``id_field`` value (a string or an
integer), or the 1-based line number when the record has no such field.
Text: one prompt per line; the id is the line number. Blank lines are skipped in both, and
a byte-order mark at the start of the file is dropped.
Parquet and CSV (parquet_rows.py, csv_rows.py): one record per row, holding only the
columns the job uses (the prompt or messages column, the id column, ``sampling_params``,
``lora_path``);
the id is the id column's value, or the 1-based row number when there is no id column.
A string in the messages or sampling_params column is JSON (in CSV every cell is a
string); a Parquet struct or list is taken as it is, less its null fields. An empty string
in the id, messages, sampling_params or lora_path column counts as null.
"""

import json
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from contbatch.jobs.csv_rows import csv_columns, read_csv_rows
from contbatch.jobs.parquet_rows import check_parquet_types, parquet_column_types, read_parquet_rows

FORMATS = ("jsonl", "text", "parquet", "csv")
TABLES = ("parquet", "csv")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "text", ".parquet": "parquet",
               ".csv": "csv"}
OVERRIDE_KEY = "sampling_params"
"""The field or column that holds a record's own sampling overrides (see records.py)."""
LORA_KEY = "lora_path"
"""The field or column that names a record's own LoRA adapter directory (see adapters.py)."""


@dataclass
class RawRecord:
    line: int  # 1-based: the line of JSONL or text input, the row of Parquet or CSV input
    id: str | int
    data: dict | str  # the JSON object (jsonl), the used columns (parquet, csv) or the prompt text (text)


@dataclass
class BadRecord:
    line: int
    id: str | int | None
    error: str


@dataclass(frozen=True)
class InputFile:
    """A job's input: the file, its format, and the fields (or columns) that hold the id and the prompt."""

    path: Path
    format: str
    id_field: str
    prompt_key: str  # the field or column holding the prompt text, or the chat messages
    chat: bool = False  # prompt_key holds chat messages

    @property
    def unit(self) -> str:
        """What a record's position counts, for messages: "line" or "row"."""
        return "row" if self.format in TABLES else "line"

    def check_columns(self) -> None:
        """Before any work: ValueError if a Parquet or CSV file has no prompt column, or a
        Parquet column has a type that cannot hold what it is used for."""
        if self.format == "csv":
            columns = csv_columns(self.path)
        elif self.format == "parquet":
            column_types = parquet_column_types(self.path)
            columns = list(column_types)
        else:
            return
        if self.prompt_key not in columns:
            what, flag = ("chat messages", "--messages-field") if self.chat else ("prompt", "--prompt-field")
            raise ValueError(
                f"{str(self.path)!r} has no column {self.prompt_key!r} for the {what}; its columns are "
                f"{', '.join(map(repr, columns)) or '(none)'}: name the right one with {flag}"
            )
        if self.format == "parquet":
            roles = {OVERRIDE_KEY: "sampling", LORA_KEY: "adapter", self.id_field: "id"}
            check_parquet_types(column_types, roles | {self.prompt_key: "messages" if self.chat else "prompt"})

    def records(self) -> Iterator[RawRecord | BadRecord]:
        """Every record of the file as a RawRecord, or a BadRecord saying what is wrong with it."""
        if self.format not in TABLES:
            yield from _read_lines(self.path, self.format, self.id_field)
            return
        read = read_csv_rows if self.format == "csv" else read_parquet_rows
        json_columns = {OVERRIDE_KEY, self.prompt_key} if self.chat else {OVERRIDE_KEY}
        with closing(read(self.path, (self.prompt_key, self.id_field, OVERRIDE_KEY, LORA_KEY))) as rows:
            for number, row in rows:
                yield _table_record(number, row, self.id_field, json_columns)


def detect_format(path: Path, input_format: str) -> str:
    """The input format: ``input_format`` itself, or for "auto" the one the file extension names."""
    if input_format in FORMATS:
        return input_format
    if input_format != "auto":
        raise ValueError(f"input_format must be 'auto' or one of {', '.join(map(repr, FORMATS))}, got {input_format!r}")
    found = _EXTENSIONS.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its extension "
            f"(known: {', '.join(sorted(_EXTENSIONS))}); give input_format (--format): {', '.join(FORMATS)}"
        )
    return found


_UTF8_BOM = b"\xef\xbb\xbf"


def _read_lines(path: Path, input_format: str, id_field: str) -> Iterator[RawRecord | BadRecord]:
    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if number == 1 and raw.startswith(_UTF8_BOM):  # as editors on Windows save UTF-8
                raw = raw[len(_UTF8_BOM) :]
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield BadRecord(number, None, f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not text.strip():
                continue
            if input_format == "text":
                yield RawRecord(number, number, text)
            else:
                yield _json_record(number, text, id_field)


def _json_record(number: int, text: str, id_field: str) -> RawRecord | BadRecord:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadRecord(number, None, f"malformed JSON: {exc.msg} (column {exc.colno})")
    if not isinstance(data, dict):
        return BadRecord(number, None, f"expected a JSON object, got {type(data).__name__}")
    return _with_id(number, data, id_field)


def _table_record(number: int, row: dict | str, id_field: str, json_columns: set) -> RawRecord | BadRecord:
    """A Parquet or CSV row (or what is wrong with it) as a record; JSON strings in ``json_columns`` decoded."""
    if isinstance(row, str):
        return BadRecord(number, None, row)
    nullable = json_columns | {id_field, LORA_KEY}
    data = {name: None if value == "" and name in nullable else value for name, value in row.items()}
    record = _with_id(number, data, id_field)
    if isinstance(record, BadRecord):
        return record
    for name in json_columns.intersection(data):
        try:
            data[name] = _json_value(data[name])
        except json.JSONDecodeError as exc:
            return BadRecord(number, record.id, f"column {name!r} is not valid JSON: {exc.msg} (character {exc.pos})")
    return record


def _with_id(number: int, data: dict, id_field: str) -> RawRecord | BadRecord:
    record_id = data.get(id_field, number)
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)) or record_id == "":
        return BadRecord(number, None, f"{id_field!r} must be a non-empty string or an integer, got {record_id!r}")
    return RawRecord(number, record_id, data)


def _json_value(value: object) -> object:
    """A JSON string decoded; a Parquet struct or list without its null fields."""
    return json.loads(value) if isinstance(value, str) else without_nulls(value)


def without_nulls(value: object) -> object:
    """An Arrow struct's row as a dict of the fields it sets. Parquet and Arrow give every row
    every field of a struct column, null where the row has none: those are absent, not set
    to null, and a struct left with no field is null itself."""
    if isinstance(value, dict):
        kept = {key: without_nulls(item) for key, item in value.items()}
        return {key: item for key, item in kept.items() if item is not None} or None
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value
