"""The results file (append-only JSONL, one line per finished record), standard output
instead of it (``-``), and the errors file. With Parquet output the same JSONL file is the
job's journal, ``<output>.journal.jsonl``, which parquet_output.py turns into the Parquet file.

Crash safety: every record is one ``os.write`` of a whole line, so it reaches the OS
page cache at once and survives the process being killed; ``fsync`` runs every
``fsync_every`` records or ``fsync_interval`` seconds (checked at each write) and on
close, which bounds what a power loss can take. A last line without its newline (the
process died mid-write) or that does not parse is cut off when the file is reopened.
Results whose records changed are removed by rewriting the file atomically (``drop``).
"""

import fcntl
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

from contbatch.jobs import fingerprints

logger = logging.getLogger("contbatch.jobs")

STDOUT = "-"
"""The output path that means standard output."""
OUTPUT_FORMATS = ("jsonl", "parquet")
JOURNAL_SUFFIX = ".journal.jsonl"
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class OutputError(ValueError):
    """The results file cannot be used: not a regular file, locked by another job, or corrupt before its last line."""


def check_output_path(path: Path) -> None:
    """OutputError unless ``path`` is a regular file (or none yet) in a directory that can hold its side files."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    use_instead = "give a file path, or '-' to write the results to standard output (no resume)"
    if not stat.S_ISREG(mode):
        kind = next((name for is_kind, name in _KINDS if is_kind(mode)), "not a regular file")
        raise OutputError(
            f"output {str(path)!r} is {kind}: results go to a regular file that a rerun reads back to resume; "
            + use_instead
        )
    directory = path.parent.resolve()
    if directory == Path("/dev") or directory.is_relative_to("/proc"):
        raise OutputError(f"output {str(path)!r} is in {directory}, which cannot hold a results file; " + use_instead)


def detect_output_format(path: Path, output_format: str) -> str:
    """The output format: ``output_format`` itself, or for "auto" parquet for a ``.parquet`` path, else jsonl."""
    if output_format == "auto":
        return "parquet" if path.suffix.lower() == ".parquet" else "jsonl"
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format must be 'auto', 'jsonl' or 'parquet', got {output_format!r}")
    if output_format == "parquet" and str(path) == STDOUT:
        raise ValueError("Parquet output needs a file: standard output ('-') gets JSONL only")
    return output_format


def journal_path(output: Path, output_format: str) -> Path:
    """The JSONL file results are appended to as they finish: the output itself, or beside a Parquet output."""
    return output.with_name(output.name + JOURNAL_SUFFIX) if output_format == "parquet" else output


class ResultWriter:
    def __init__(self, path: Path, fsync_every: int = 1000, fsync_interval: float = 5.0) -> None:
        self.path = path
        self.fsync_every = fsync_every
        self.fsync_interval = fsync_interval
        self.created = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OutputError(f"{path} is being written by another running job") from None
        if self.created:
            fsync_directory(path.parent)
        try:
            self.done = self._scan_and_repair()  # id -> fingerprint (None if the result has none)
        except BaseException:
            os.close(self.fd)
            raise
        self.num_written = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        _write_all(self.fd, encode_line(record))
        self.num_written += 1
        self._unsynced += 1
        if self._unsynced >= self.fsync_every or time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.fd)
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self, remove_if_unused: bool = False) -> None:
        """fsync and close; with ``remove_if_unused``, delete the file if this run created it and wrote nothing."""
        if self.fd < 0:
            return
        self.sync()
        if remove_if_unused and self.created and self.num_written == 0:
            self.path.unlink()
        os.close(self.fd)  # also releases the lock
        self.fd = -1

    def drop(self, ids: set) -> None:
        """Remove the results of ``ids``: a copy without them is written, fsynced and locked,
        then renamed over the file, so a kill at any moment leaves the old file or the new one,
        each whole, and no other job can take the file in between."""
        temporary = self.path.with_name(self.path.name + ".redo.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, stat.S_IMODE(os.fstat(self.fd).st_mode))
            with open(self.path, "rb") as source:
                for raw in source:
                    if json.loads(raw)["id"] not in ids:
                        _write_all(fd, raw)
            os.fsync(fd)
            os.replace(temporary, self.path)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        fsync_directory(self.path.parent)
        os.close(self.fd)
        self.fd = fd
        for record_id in ids:
            self.done.pop(record_id, None)

    def _scan_and_repair(self) -> dict:
        """{id: fingerprint} of the complete records; cuts off a torn or unparsable last line."""
        ids: dict = {}
        good_end = 0  # byte offset just past the last good line
        bad_line = None  # (line number, reason) of an unparsable line, fatal unless it is the last
        with open(self.path, "rb") as source:
            for number, raw in enumerate(source, start=1):
                if bad_line is not None:
                    raise OutputError(
                        f"{self.path} line {bad_line[0]} is corrupt ({bad_line[1]}) and is not the last line; "
                        "fix or delete that line, then rerun"
                    )
                if not raw.endswith(b"\n"):
                    bad_line = (number, "no newline")
                    continue
                try:
                    result = json.loads(raw)
                    ids[result["id"]] = fingerprints.decode(result)
                except (ValueError, KeyError, TypeError) as exc:
                    bad_line = (number, f"{type(exc).__name__}: {exc}")
                    continue
                good_end += len(raw)
        size = os.fstat(self.fd).st_size
        if size > good_end:
            logger.warning(
                "%s: cut off a torn last line (%d bytes, line %d) left by an interrupted run",
                self.path, size - good_end, bad_line[0],
            )
            os.ftruncate(self.fd, good_end)
            os.fsync(self.fd)
        return ids


class StdoutWriter:
    """Results to standard output as they finish (``-``): nothing to resume, no file beside it."""

    def __init__(self) -> None:
        self.path = Path(STDOUT)
        self.done: dict = {}
        self.num_written = 0

    def write(self, record: dict) -> None:
        sys.stdout.flush()  # whatever was printed before stays before
        data = encode_line(record)
        binary = getattr(sys.stdout, "buffer", None)
        if binary is None:  # e.g. a notebook's stream
            sys.stdout.write(data.decode("utf-8"))
            sys.stdout.flush()
        else:
            binary.write(data)
            binary.flush()
        self.num_written += 1

    def close(self, remove_if_unused: bool = False) -> None:
        """Nothing to do: every line was flushed as it was written."""


class ErrorLog:
    """``<output>.errors.jsonl``: one {"line", "id", "error"} object per bad record of the latest run.

    Recreated by every run (bad records are found again, since they are never in the
    results), and only created when there is an error. With ``path`` None (results to
    standard output) it only counts them.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.count = 0
        self._file = None
        if path is not None:
            path.unlink(missing_ok=True)

    def write(self, line: int, record_id: str | int | None, error: str) -> None:
        if self.path is None:
            self.count += 1
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps({"line": line, "id": record_id, "error": error}, ensure_ascii=False) + "\n")
        self._file.flush()
        self.count += 1

    def close(self) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def fsync_directory(directory: Path) -> None:
    """Make a file's creation or rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
