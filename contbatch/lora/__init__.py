"""LoRA adapters served beside the base model: each request may name one (vLLM's ``lora_request``).

- request.py: ``LoRARequest``, the adapter a request runs with (vLLM's fields).
- peft_files.py: reading a PEFT adapter directory into low-rank pairs per linear layer.
- layers.py: the rows of a step each adapter covers, and the update each adapted layer adds.
- registry.py: the adapters loaded into one model, owned by the model runner.
"""

from contbatch.lora.request import LoRARequest

__all__ = ["LoRARequest"]
