"""RMSNorm, computed in fp32 and cast back in the same order as HF transformers.

With a residual it is the fused "add then normalise" of pre-norm decoders: one pass
over memory instead of separate add and norm kernels (contbatch.ops.fused_add_rms_norm).
"""

import torch
from torch import nn

from contbatch import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        ops.rms_norm(out, rows, self.weight, self.eps)
        return out.view(x.shape)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), computed in place in ``x`` and ``residual``
        (both [tokens, size], contiguous rows)."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual
