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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight): its checkpoints store weight - 1.

    ``fold_one`` adds the 1 into the loaded weight once (in fp32, as transformers adds it,
    then in the model's dtype), so the same fused kernels run every step. In fp32 that is
    transformers' result; in bf16 the folded weight and the normalised row are each rounded,
    where transformers multiplies in fp32 and rounds once (about a bf16 step apart).
    """

    def fold_one(self) -> None:
        with torch.no_grad():
            self.weight.copy_(self.weight.float() + 1.0)
