"""Reading CSV input lazily with Python's csv module: the header's column names, then one
{column: cell} dict per row.

The file is UTF-8 (a leading BOM is dropped, as spreadsheets write one); quoted cells may
hold commas, quotes and newlines. Rows are numbered from 1 after the header; blank rows
are skipped but counted, as blank JSONL lines are.
"""

import csv
from collections.abc import Collection, Iterator
from pathlib import Path

_LARGEST_CELL = 2**31 - 1
"""A prompt may be a whole document: csv's default cap on a cell (128 Ki characters) would refuse it."""


def csv_columns(path: Path) -> list[str]:
    """The column names of the header row (none for an empty file)."""
    with _open(path) as source:
        return next(csv.reader(source), [])


def read_csv_rows(path: Path, columns: Collection[str]) -> Iterator[tuple[int, dict | str]]:
    """(row number, {column: cell} of ``columns`` that the header has) for every non-blank row,
    or (row number, what is wrong with the row) for one that cannot be used."""
    csv.field_size_limit(max(csv.field_size_limit(), _LARGEST_CELL))
    with _open(path) as source:
        rows = csv.reader(source)
        header = next(rows, [])
        wanted = {name: header.index(name) for name in columns if name in header}
        number = 0
        while True:
            number += 1
            try:
                row = next(rows)
            except StopIteration:
                return
            except csv.Error as exc:
                yield number, f"unreadable CSV row: {exc}"
                continue
            if not row or (len(row) == 1 and not row[0].strip()):  # a blank line
                continue
            if len(row) != len(header):
                yield number, f"row has {len(row)} cells, the header has {len(header)} columns"
                continue
            cells = {name: row[index] for name, index in wanted.items()}
            yield number, _undecodable(cells) or cells


def _open(path: Path):
    # surrogateescape: a cell that is not UTF-8 spoils its own row only (see _undecodable).
    return open(path, encoding="utf-8-sig", errors="surrogateescape", newline="")


def _undecodable(cells: dict) -> str | None:
    """What is wrong with a row whose cells are not valid UTF-8, or None."""
    for name, cell in cells.items():
        try:
            cell.encode("utf-8")
        except UnicodeEncodeError:
            return f"column {name!r} is not valid UTF-8"
    return None
