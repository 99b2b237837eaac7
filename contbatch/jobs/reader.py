"""Reading a job's input file lazily, one line at a time, into records with ids.

JSONL: one JSON object per line; the id is the ``id_field`` value (a string or an
integer), or the 1-based line number when the record has no such field.
Text: one prompt per line; the id is the line number. Blank lines are skipped in both.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("jsonl", "text")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "text"}


@dataclass
class RawRecord:
    line: int
    id: str | int
    data: dict | str  # the JSON object (jsonl) or the prompt text (text)


@dataclass
class BadRecord:
    line: int
    id: str | int | None
    error: str


def detect_format(path: Path, input_format: str) -> str:
    """The input format: ``input_format`` itself, or for "auto" the one the file extension names."""
    if input_format in FORMATS:
        return input_format
    if input_format != "auto":
        raise ValueError(f"input_format must be 'auto', 'jsonl' or 'text', got {input_format!r}")
    found = _EXTENSIONS.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its extension "
            f"(known: {', '.join(sorted(_EXTENSIONS))}); give input_format='jsonl' or 'text' (--format)"
        )
    return found


def read_lines(path: Path, input_format: str, id_field: str) -> Iterator[RawRecord | BadRecord]:
    """Every non-blank line of ``path`` as a RawRecord, or a BadRecord saying what is wrong with it."""
    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
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
    record_id = data.get(id_field, number)
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        return BadRecord(number, None, f"{id_field!r} must be a string or an integer, got {record_id!r}")
    return RawRecord(number, record_id, data)
