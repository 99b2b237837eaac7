"""The LoRA adapters of one job: the job-wide one (``--lora``) and those records name.

A record names its own adapter by directory in its ``"lora_path"`` field (or column); null
means the job's default (the job-wide adapter, else the base model). Each distinct directory
becomes one ``LoRARequest``, named after the directory, with an id above any the job or its
LLM already uses (the job-wide adapter, and one the LLM loaded before for that directory, are
reused), so the engine reads it once and its requests share cached prefixes. Each directory's
content fingerprint is read once a job and goes into the fingerprint of every record that
names it (fingerprints.py): a resume after an adapter was retrained in place is refused
instead of keeping the old adapter's results.
"""

import os
from pathlib import Path

from contbatch.jobs.reader import LORA_KEY
from contbatch.jobs.settings import model_fingerprint
from contbatch.lora.by_path import AdaptersByPath, checked_adapter_path
from contbatch.lora.request import LoRARequest


class JobAdapters(AdaptersByPath):
    """The job's adapters by directory, and each directory's content fingerprint."""

    def __init__(self, job_wide: LoRARequest | None) -> None:
        super().__init__([] if job_wide is None else [job_wide])
        self._digests: dict[str, str] = {}  # a directory as records give it -> its content fingerprint

    def digest(self, path: str) -> str:
        """The adapter directory's content fingerprint ("" if it is not a directory: such a
        record fails as it starts, and a later resume with the directory in place redoes it)."""
        if path not in self._digests:
            self._digests[path] = model_fingerprint(Path(path)) if os.path.isdir(path) else ""
        return self._digests[path]


def named_adapter(data: dict) -> str | None:
    """A record's own adapter directory, None when it names none."""
    return checked_adapter_path(data.get(LORA_KEY), f"field {LORA_KEY!r}")
