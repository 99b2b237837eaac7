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
from contbatch.lora.request import LoRARequest


def adapter_name(path: str) -> str:
    """An adapter's name: its directory's name."""
    return os.path.basename(os.path.normpath(path)) or "adapter"


class JobAdapters:
    def __init__(self, job_wide: LoRARequest | None) -> None:
        self._requests: dict[str, LoRARequest] = {}  # absolute directory -> its request
        self._digests: dict[str, str] = {}  # a directory as records give it -> its content fingerprint
        self._next_id = 1
        if job_wide is not None:
            self.know([job_wide])

    def know(self, requests: list[LoRARequest]) -> None:
        """Adapters in use already (those the LLM has loaded): reused for their directories,
        their ids never given to another."""
        for request in requests:
            self._requests.setdefault(os.path.abspath(request.lora_path), request)
            self._next_id = max(self._next_id, request.lora_int_id + 1)

    def request(self, path: str) -> LoRARequest:
        """The request for the adapter at ``path``, the same one each time the job names it."""
        key = os.path.abspath(path)
        if key not in self._requests:
            self._requests[key] = LoRARequest(adapter_name(path), self._next_id, path)
            self._next_id += 1
        return self._requests[key]

    def digest(self, path: str) -> str:
        """The adapter directory's content fingerprint ("" if it is not a directory: such a
        record fails as it starts, and a later resume with the directory in place redoes it)."""
        if path not in self._digests:
            self._digests[path] = model_fingerprint(Path(path)) if os.path.isdir(path) else ""
        return self._digests[path]


def named_adapter(data: dict) -> str | None:
    """A record's own adapter directory, None when it names none; TypeError/ValueError when
    its ``lora_path`` is not a non-empty string."""
    path = data.get(LORA_KEY)
    if path is None:
        return None
    if not isinstance(path, str):
        raise TypeError(f"field {LORA_KEY!r} must be a LoRA adapter directory (a string), got {type(path).__name__}")
    if not path.strip():
        raise ValueError(f"field {LORA_KEY!r} is empty; leave it out (or null) for the job's default adapter")
    return path
