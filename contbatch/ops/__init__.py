"""Cache and attention ops: the compiled ``contbatch._C`` kernels when built, else the reference.

The compiled extension registers ``torch.ops.contbatch.*`` (cache and attention ops, the
fused layer ops, the sampler's argmax_rows, bf16_linear) with the same signatures and
semantics as :mod:`contbatch.ops.reference`.
"""

import importlib
import logging
import os
from types import ModuleType

import torch

from contbatch.ops import reference

logger = logging.getLogger(__name__)


def _load_native() -> ModuleType | None:
    if os.environ.get("CONTBATCH_FORCE_REFERENCE_OPS") == "1":
        return None
    try:
        importlib.import_module("contbatch._C")  # importing registers the ops
    except ImportError as exc:
        logger.warning(
            "contbatch C++ extension not built (%s); using the slower PyTorch reference ops. "
            "Build it with `pip install -e . --no-build-isolation`.",
            exc,
        )
        return None
    return torch.ops.contbatch


_native = _load_native()

BACKEND: str = "native" if _native is not None else "reference"
"""Which implementation the engine runs: "native" (csrc/) or "reference" (PyTorch)."""

if _native is not None:
    reshape_and_cache = _native.reshape_and_cache
    paged_attention = _native.paged_attention
    copy_blocks = _native.copy_blocks
else:
    reshape_and_cache = reference.reshape_and_cache
    paged_attention = reference.paged_attention
    copy_blocks = reference.copy_blocks



def _native_on_cpu(name: str):
    """The fused layer ops and argmax_rows have CPU kernels only: tensors elsewhere take the reference."""
    native, fallback = getattr(_native, name), getattr(reference, name)

    def op(*args):
        return native(*args) if args[1].device.type == "cpu" else fallback(*args)

    op.__name__ = name
    return op


ROW_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "argmax_rows")
if _native is not None:
    rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, argmax_rows = map(_native_on_cpu, ROW_OPS)
else:
    rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, argmax_rows = (getattr(reference, n) for n in ROW_OPS)


def fast_bf16_linear_available() -> bool:
    """Whether ``bf16_linear`` runs the AVX512_BF16 kernel now: only then do bf16 weights
    take its panel layout (elsewhere oneDNN's own layout is faster)."""
    return _native is not None and _native.cpu_kernel_isa() == "avx512_bf16"


bf16_linear = _native.bf16_linear if _native is not None else reference.bf16_linear

__all__ = [
    "BACKEND",
    "reshape_and_cache",
    "paged_attention",
    "copy_blocks",
    *ROW_OPS,
    "bf16_linear",
    "fast_bf16_linear_available",
    "reference",
]
