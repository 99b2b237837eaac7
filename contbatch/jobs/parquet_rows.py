"""Reading Parquet input lazily: the file's column types (from its footer), then one
{column: value} dict per row, read one record batch at a time (``ParquetFile.iter_batches``)
and only for the columns the job uses, so a file of any length is never held in memory.
Rows are numbered from 1."""

from collections.abc import Collection, Iterator
from pathlib import Path

from contbatch.jobs.pyarrow_required import import_pyarrow

BATCH_ROWS = 1024


def _is_text(types, arrow_type) -> bool:
    return types.is_string(arrow_type) or types.is_large_string(arrow_type)


_ROLES = {  # role -> (what its column must hold, the test of an Arrow type)
    "prompt": ("strings", _is_text),
    "messages": ("lists of {role, content} structs, or JSON strings",
                 lambda types, t: types.is_list(t) or types.is_large_list(t) or _is_text(types, t)),
    "id": ("integers or strings", lambda types, t: types.is_integer(t) or _is_text(types, t)),
    "sampling": ("structs of SamplingParams fields, or JSON strings",
                 lambda types, t: types.is_struct(t) or _is_text(types, t)),
    "adapter": ("strings (LoRA adapter directories)", _is_text),
}


def parquet_column_types(path: Path) -> dict:
    """{column name: Arrow type} from the file's footer; ValueError if it is not a Parquet file."""
    pyarrow, parquet = import_pyarrow()
    try:
        schema = parquet.read_schema(path)
    except pyarrow.ArrowException as exc:
        raise ValueError(f"{str(path)!r} is not a readable Parquet file: {exc}") from exc
    return {field.name: field.type for field in schema}


def check_parquet_types(column_types: dict, roles: dict[str, str]) -> None:
    """ValueError if a column that plays a role ({column: "prompt", "messages", "id",
    "sampling" or "adapter"}) has a type that cannot hold it; columns the file lacks are not checked."""
    types = import_pyarrow()[0].types
    for column, role in roles.items():
        if column not in column_types:
            continue
        column_type = column_types[column]
        plain = column_type.value_type if types.is_dictionary(column_type) else column_type
        what, accepts = _ROLES[role]
        if not accepts(types, plain):
            raise ValueError(f"column {column!r} has type {column_type}; the {role} column must hold {what}")


def read_parquet_rows(path: Path, columns: Collection[str]) -> Iterator[tuple[int, dict]]:
    """(row number, {column: value} of ``columns`` that the file has) for every row."""
    parquet = import_pyarrow()[1]
    with parquet.ParquetFile(path) as source:
        present = [name for name in columns if name in source.schema_arrow.names]
        number = 0
        for batch in source.iter_batches(batch_size=BATCH_ROWS, columns=present):
            for row in batch.to_pylist():
                number += 1
                yield number, row
