"""One ``LoRARequest`` per adapter directory, for callers that name adapters by path (a bulk
job's records, Ray Data rows): each directory gets a name (its own) and an id that no adapter
already in use has, and the same request every time it is named, so the engine reads it once
and its requests share cached prefixes."""

import os

from contbatch.lora.request import LoRARequest


def checked_adapter_path(value: object, what: str) -> str | None:
    """``value`` as an adapter directory, None for none; TypeError/ValueError naming ``what``
    (e.g. "field 'lora_path'") when it is not a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a LoRA adapter directory (a string), got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{what} is empty; leave it out (or null) for the default adapter")
    return value


def adapter_name(path: str) -> str:
    """An adapter's name: its directory's name."""
    return os.path.basename(os.path.normpath(path)) or "adapter"


class AdaptersByPath:
    def __init__(self, in_use: list[LoRARequest] = ()) -> None:
        self._requests: dict[str, LoRARequest] = {}  # absolute directory -> its request
        self._next_id = 1
        self.know(in_use)

    def know(self, requests: list[LoRARequest]) -> None:
        """Adapters in use already (given by the caller, or loaded by the LLM): reused for their
        directories, their ids never given to another."""
        for request in requests:
            self._requests.setdefault(os.path.abspath(request.lora_path), request)
            self._next_id = max(self._next_id, request.lora_int_id + 1)

    def request(self, path: str) -> LoRARequest:
        """The request for the adapter at ``path``, the same one each time it is named."""
        key = os.path.abspath(path)
        if key not in self._requests:
            self._requests[key] = LoRARequest(adapter_name(path), self._next_id, path)
            self._next_id += 1
        return self._requests[key]
