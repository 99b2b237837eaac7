"""LoRARequest: which adapter a request runs with, named as vLLM names it."""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for ``LLM.generate``/``chat`` (``lora_request=``), as in vLLM.

    Attributes:
        lora_name: a name for the adapter (reported back, not used to find it).
        lora_int_id: the adapter's identity, an int >= 1: requests with the same id share one
            loaded copy and each other's cached prompt prefixes; one id always means one path.
        lora_path: a PEFT adapter directory (``adapter_config.json`` and
            ``adapter_model.safetensors``), as ``PeftModel.save_pretrained`` writes it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a PEFT adapter directory, got {self.lora_path!r}")
