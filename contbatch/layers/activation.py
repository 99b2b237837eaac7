"""Gated MLP activations over a fused [gate | up] projection."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from contbatch import ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
    ops.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, op by op as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}
"""transformers' activation name -> the gated activation over [gate | up]."""
