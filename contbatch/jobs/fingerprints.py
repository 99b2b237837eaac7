"""Record fingerprints: which input record each result was made from, so that a resume
cannot keep a result under an id whose record has changed.

Each result carries ``"fingerprint": {"prompt": hex, "sampling": hex}``: 8 bytes of sha256
over the record's prompt as given (the text line, or the JSON value of the prompt or
messages field) and 8 over its own sampling overrides as given, with, for a record that names
its own LoRA adapter, the directory and its content fingerprint (adapters.py; a record that
names none hashes as before adapters existed, so older results still match). The job-wide settings
(model, default SamplingParams, fields) are in the settings file instead (settings.py):
``force`` may change those without turning every result into a mismatch.
"""

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from contbatch.jobs.adapters import named_adapter
from contbatch.jobs.reader import LORA_KEY, BadRecord, RawRecord
from contbatch.jobs.records import sampling_overrides

logger = logging.getLogger("contbatch.jobs")

KEY = "fingerprint"
_DIGEST_BYTES = 8
_COMPARED = object()
"""Replaces a result's fingerprint in the done map once its input record has been compared."""


class InputMismatch(ValueError):
    """Existing results do not match the input records that now have their ids, or cannot be checked."""


AdapterDigest = Callable[[str], str]
"""An adapter directory's content fingerprint (JobAdapters.digest)."""


def fingerprint(record: RawRecord, prompt_key: str, adapter_digest: AdapterDigest) -> bytes:
    """The digest of the record's prompt, then that of its own sampling overrides and adapter (16 bytes)."""
    if isinstance(record.data, str):
        return _digest(record.data) + _digest(None)
    return _digest(record.data.get(prompt_key)) + _digest(_own_settings(record.data, adapter_digest))


def _own_settings(data: dict, adapter_digest: AdapterDigest) -> object:
    overrides = sampling_overrides(data)
    given = data.get(LORA_KEY)
    if given is None:
        return overrides
    try:
        digest = adapter_digest(named_adapter(data))
    except (TypeError, ValueError):  # not a directory name: a bad record, compared as given
        digest = ""
    return {"sampling_params": overrides, LORA_KEY: given, "adapter": digest}


def encode(value: bytes) -> dict:
    """The JSON form stored in a result line."""
    return {"prompt": value[:_DIGEST_BYTES].hex(), "sampling": value[_DIGEST_BYTES:].hex()}


def decode(result: dict) -> bytes | None:
    """A result line's fingerprint, or None if it has none (written by an older contbatch);
    ValueError/KeyError/TypeError if it is malformed."""
    stored = result.get(KEY)
    if stored is None:
        return None
    value = bytes.fromhex(stored["prompt"]) + bytes.fromhex(stored["sampling"])
    if len(value) != 2 * _DIGEST_BYTES:
        raise ValueError(f"a fingerprint has {2 * _DIGEST_BYTES} bytes, got {len(value)}")
    return value


@dataclass
class ResumeCheck:
    """What comparing the existing results with the input found."""

    changed: set = field(default_factory=set)  # ids whose input record has another prompt or sampling now
    unchecked: set = field(default_factory=set)  # ids of results without a fingerprint
    first_changed: str = ""
    not_in_input: int = 0

    def to_redo(self, output: Path, redo_mismatched: bool, force: bool) -> set:
        """The ids to generate again; InputMismatch when results differ (or cannot be checked)
        and no flag says what to do with them."""
        if self.not_in_input:
            logger.warning("%s: %d result(s) have ids that are not in the input (kept)", output, self.not_in_input)
        if redo_mismatched:
            return self.changed | self.unchecked
        if self.changed:
            raise InputMismatch(
                f"{output}: {len(self.changed)} existing result(s) do not match the input record with the same id "
                f"(first: {self.first_changed}); a line was inserted or edited, or this output belongs to another "
                "input file. Pass --redo-mismatched (redo_mismatched=True) to generate them again and replace "
                "their results, or choose another output"
            )
        if self.unchecked and not force:
            raise InputMismatch(
                f"{output}: {len(self.unchecked)} existing result(s) have no fingerprint (written by an older "
                "contbatch), so a resume cannot check that they match the input. Pass --redo-mismatched "
                "(redo_mismatched=True) to generate them again, --force (force=True) to keep them unchecked, "
                "or choose another output"
            )
        return set()


def check_results(
    records: Iterable[RawRecord | BadRecord], done: dict, prompt_key: str, adapter_digest: AdapterDigest,
    unit: str = "line",
) -> ResumeCheck:
    """Compare each result in ``done`` (id -> fingerprint, None if it has none) with the first
    input record that has its id (``unit`` names its position: "line" or "row"). The compared
    values are replaced by a marker, which needs no second set of ids (only the keys of ``done``
    are used afterwards)."""
    check = ResumeCheck()
    for record in records:
        stored = _COMPARED if isinstance(record, BadRecord) else done.get(record.id, _COMPARED)
        if stored is _COMPARED:  # bad, not in the results, or an id compared already
            continue
        done[record.id] = _COMPARED
        if stored is None:
            check.unchecked.add(record.id)
            continue
        current = fingerprint(record, prompt_key, adapter_digest)
        if current != stored:
            if not check.changed:
                check.first_changed = _describe(record, stored, current, unit)
            check.changed.add(record.id)
    check.not_in_input = sum(1 for value in done.values() if value is not _COMPARED)
    return check


def _describe(record: RawRecord, stored: bytes, current: bytes, unit: str) -> str:
    prompt, sampling = (stored[part] != current[part] for part in (slice(_DIGEST_BYTES), slice(_DIGEST_BYTES, None)))
    what = {
        (True, False): "the prompt differs",
        (False, True): "the sampling settings or LoRA adapter differ",
        (True, True): "the prompt and the sampling settings or LoRA adapter differ",
    }[(prompt, sampling)]
    return f"id {record.id!r} at input {unit} {record.line}: {what}"


def _digest(value: object) -> bytes:
    # default=repr: a Parquet value that JSON cannot hold (bytes, a date) must not break a resume check.
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("ascii")).digest()[:_DIGEST_BYTES]
