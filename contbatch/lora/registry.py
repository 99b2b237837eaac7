"""The LoRA adapters loaded into one model; the model runner owns it.

An adapter is read once, the first time a request names its ``lora_int_id``, and stays loaded
for the life of the ``LLM`` (a rank-16 adapter of every projection of SmolLM2-135M is about
10 MB in fp32). Each adapted ``Linear`` gets a ``LinearLoRA`` holding every loaded adapter's
update of that layer; all of them read one ``StepAdapters``, which the runner sets each step.
"""

import torch
from torch import nn

from contbatch.layers.linear import Linear
from contbatch.lora.layers import LinearLoRA, LoRAPair, StepAdapters
from contbatch.lora.peft_files import read_adapter
from contbatch.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, model: nn.Module, max_rank: int, device: torch.device) -> None:
        self.model = model
        self.max_rank = max_rank
        self.device = device
        self.step = StepAdapters()
        self.loaded: dict[int, LoRARequest] = {}  # lora_int_id -> the request that loaded it
        model.step_adapters = self.step  # the model skips paths that would not apply the updates

    def load(self, request: LoRARequest) -> None:
        """Make ``request``'s adapter available (once per id); ValueError if it cannot be served,
        or if its id was loaded from another path."""
        known = self.loaded.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} is the adapter at {known.lora_path!r} "
                                 f"already; {request.lora_path!r} needs an id of its own")
            return
        pairs = read_adapter(request.lora_path, self.model, self.max_rank)  # every check before any change
        for layer, pair in pairs.items():
            linear: Linear = self.model.get_submodule(layer)
            if linear.lora is None:
                linear.lora = LinearLoRA(self.step)
            linear.lora.pairs[request.lora_int_id] = LoRAPair(pair.a_t.to(self.device), pair.b_t.to(self.device))
        self.loaded[request.lora_int_id] = request

    def set_step(self, row_adapters: list[tuple[int, int, int]]) -> None:
        """The rows each adapter covers in the step about to run: (adapter id, first row, end row)."""
        if row_adapters:
            self.step.set(row_adapters, self.device)
        else:
            self.step.clear()
