"""An embedding table kept in 8-bit blocks (``LLM(quantization="int8", quantize_embeddings=True)``).

It is stored in the int8 linear kernel's panel layout (contbatch/ops/int8_blocks.py), so a
tied LM head and the lookup share one int8 copy: a lookup gathers each token's row (its
column of a panel) and dequantizes it into the model's dtype.
"""

import torch
from torch import nn

from contbatch.ops.int8_blocks import PANEL_COLUMNS, PackedInt8


class Int8Embedding(nn.Module):
    def __init__(self, packed: PackedInt8, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        panel, column = ids // PANEL_COLUMNS, ids % PANEL_COLUMNS
        stored = self.packed.values[panel, :, :, column, :]  # [tokens, blocks, quads, 4], q + offset
        scales = self.packed.scales[panel, :, column]  # [tokens, blocks]
        values = stored.reshape(len(ids), -1, self.packed.block).to(torch.float32) - self.packed.offset
        rows = values * scales.to(torch.float32).unsqueeze(-1)
        hidden = rows.reshape(len(ids), -1)[:, : self.embedding_dim].to(self.dtype)
        return hidden.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 blocks of {self.packed.block}"
