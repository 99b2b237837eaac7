"""Writing a Parquet results file from the job's journal once every record is done.

A Parquet file cannot be appended to safely, so results are first appended to the journal
(``<output>.journal.jsonl``, the crash-safe JSONL of output.ResultWriter, which every resume
reads). When a run ends with the job done, the journal becomes ``<output>``: its results in
input order (then any whose id is no longer in the input, in journal order), written to a
temporary file beside it, fsynced and renamed over it, so a kill at any moment leaves the
previous file (or none) or the new one, each whole. The file's metadata holds the journal's
sha256: a rerun that leaves the journal as it was leaves the file as it is.
"""

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from contbatch.jobs.output import OutputError, fsync_directory
from contbatch.jobs.parquet_schema import arrow_row, ids_fit_int64, results_schema
from contbatch.jobs.pyarrow_required import import_pyarrow

JOURNAL_DIGEST_KEY = b"contbatch.journal_sha256"
BATCH_ROWS = 4096
_READ_BYTES = 1 << 20


@dataclass
class _JournalIndex:
    offsets: dict = field(default_factory=dict)  # id -> byte offset of its result line, in journal order
    completion_fields: set = field(default_factory=set)
    prompt_logprobs: bool = False  # some result has them


def check_replaceable(output: Path) -> None:
    """OutputError if ``output`` exists but is not a results file written here: the finished
    job would replace it, and it may be someone's data (another input file, say)."""
    if output.exists() and _stored_digest(import_pyarrow()[1], output) is None:
        raise OutputError(
            f"{str(output)!r} exists and is not a Parquet results file written by contbatch, so the job would "
            "replace it once done; choose another output, or delete it first"
        )


def write_parquet(journal: Path, output: Path, input_ids: Iterable) -> bool:
    """Write ``output`` from ``journal``, ordered as ``input_ids``; False (nothing written)
    when ``output`` was written from this very journal already."""
    pyarrow, parquet = import_pyarrow()
    digest = _sha256(journal).encode()
    if _stored_digest(parquet, output) == digest:
        return False
    index = _index(journal)
    int_ids = ids_fit_int64(index.offsets)
    schema = results_schema(pyarrow, int_ids, index.completion_fields, index.prompt_logprobs)
    schema = schema.with_metadata({JOURNAL_DIGEST_KEY: digest})
    temporary = output.with_name(output.name + ".tmp")
    try:
        with open(journal, "rb") as source, open(temporary, "wb") as sink:
            with parquet.ParquetWriter(sink, schema) as writer:
                for batch in _batches(source, _in_order(index.offsets, input_ids)):
                    rows = [arrow_row(result, int_ids) for result in batch]
                    writer.write_batch(pyarrow.RecordBatch.from_pylist(rows, schema=schema))
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, output)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(output.parent)
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _stored_digest(parquet, output: Path) -> bytes | None:
    """The journal digest in ``output``'s metadata; None if there is no such file or it has none."""
    try:
        metadata = parquet.read_schema(output).metadata
    except (OSError, ValueError):  # no file yet, or not one this job wrote
        return None
    return (metadata or {}).get(JOURNAL_DIGEST_KEY)


def _index(journal: Path) -> _JournalIndex:
    index = _JournalIndex()
    offset = 0
    with open(journal, "rb") as source:
        for raw in source:
            result = json.loads(raw)
            index.offsets[result["id"]] = offset
            for completion in result["outputs"]:
                index.completion_fields.update(completion)
            index.prompt_logprobs |= "prompt_logprobs" in result
            offset += len(raw)
    return index


def _in_order(offsets: dict, input_ids: Iterable) -> Iterator[int]:
    """The offsets of the results of ``input_ids`` in that order (the first of repeated ids),
    then those of results whose id is not in the input. Empties ``offsets``."""
    for record_id in input_ids:
        offset = offsets.pop(record_id, None)
        if offset is not None:
            yield offset
    yield from offsets.values()


def _batches(source: BinaryIO, offsets: Iterator[int]) -> Iterator[list[dict]]:
    """The result objects at ``offsets``, BATCH_ROWS at a time."""
    batch = []
    for offset in offsets:
        source.seek(offset)
        batch.append(json.loads(source.readline()))
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch
