"""The results file (append-only JSONL, one line per finished record) and the errors file.

Crash safety: every record is one ``os.write`` of a whole line, so it reaches the OS
page cache at once and survives the process being killed; ``fsync`` runs every
``fsync_every`` records or ``fsync_interval`` seconds (checked at each write) and on
close, which bounds what a power loss can take. A last line without its newline (the
process died mid-write) or that does not parse is cut off when the file is reopened.
"""

import fcntl
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("contbatch.jobs")

HANG_AT_ENV = "CONTBATCH_JOBS_TEST_HANG_AT"
"""Test hook: hang half-way through writing this run's Nth record, leaving a torn line."""


class OutputError(ValueError):
    """The results file cannot be used: locked by another job or corrupt before its last line."""


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
            self.done_ids, self.num_existing = self._scan_and_repair()
        except BaseException:
            os.close(self.fd)
            raise
        self.num_written = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._hang_at = int(os.environ.get(HANG_AT_ENV, "0"))

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "replace")
        if self.num_written + 1 == self._hang_at:
            _write_all(self.fd, data[: len(data) // 2])
            time.sleep(3600)
        _write_all(self.fd, data)
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

    def _scan_and_repair(self) -> tuple[set, int]:
        """Ids of the complete records; cuts off a torn or unparsable last line."""
        ids: set = set()
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
                    ids.add(json.loads(raw)["id"])
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
        return ids, len(ids)


class ErrorLog:
    """``<output>.errors.jsonl``: one {"line", "id", "error"} object per bad record of the latest run.

    Recreated by every run (bad records are found again, since they are never in the
    results), and only created when there is an error.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self._file = None
        path.unlink(missing_ok=True)

    def write(self, line: int, record_id: str | int | None, error: str) -> None:
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
