"""SiLU-gated MLP activation over a fused [gate | up] projection."""

import torch

from contbatch import ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
    ops.silu_and_mul(out, gate_up)
    return out
