"""Cache and attention ops: the compiled ``contbatch._C`` kernels when built, else the reference.

The compiled extension registers ``torch.ops.contbatch.*`` (cache and attention ops, the
fused layer ops, the sampler's argmax_rows and sample_rows, bf16_linear) with the same signatures and
semantics as :mod:`contbatch.ops.reference`.
"""

import importlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType

import torch

from contbatch.ops import int8_blocks, reference

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
    """The fused layer ops and the sampler's have CPU kernels only: tensors elsewhere take the reference."""
    native, fallback = getattr(_native, name), getattr(reference, name)

    def op(*args):
        return native(*args) if args[1].is_cpu else fallback(*args)  # is_cpu: 5x faster than .device

    op.__name__ = name
    return op


ROW_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "argmax_rows", "sample_rows")
if _native is not None:
    rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, argmax_rows, sample_rows = map(_native_on_cpu, ROW_OPS)
else:
    rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, argmax_rows, sample_rows = (
        getattr(reference, n) for n in ROW_OPS
    )


CPU_ISAS = ("generic", "avx2", "avx512", "avx512_bf16")
"""The CPU kernels' ISA tiers, slowest first (csrc/cpu/cpu_isa.h)."""


def _choose_isa_from_environment() -> None:
    """Applies CONTBATCH_CPU_ISA, CONTBATCH_INT8_KERNEL and CONTBATCH_AMX once, at import: a tier or int8
    kernel this CPU lacks is refused here, before any model loads, not on the first op call.
    The int8 kernel variable is how a benchmark runs, say, AVX2's vpmaddubsw kernel on a CPU
    that also has AVX-VNNI (an AVX2-only CPU's kernel on the machine at hand)."""
    isa = os.environ.get("CONTBATCH_CPU_ISA", "auto")
    int8_kernel = os.environ.get("CONTBATCH_INT8_KERNEL", "auto")
    if _native is None:
        for variable, value in (("CONTBATCH_CPU_ISA", isa), ("CONTBATCH_INT8_KERNEL", int8_kernel)):
            if value not in ("auto", "", "generic"):
                raise ValueError(f"{variable}={value}: the C++ extension is not built, so only the "
                                 "PyTorch reference ops run; unset it or build the extension")
        return
    set_cpu_isa(isa)
    if os.environ.get("CONTBATCH_AMX", "1") == "0":
        _native.set_amx_linears(False)
    if int8_kernel not in ("auto", ""):
        try:
            _native.set_int8_kernel(int8_kernel)
        except ValueError as error:  # names the kernels this CPU runs
            raise ValueError(f"CONTBATCH_INT8_KERNEL={int8_kernel}: {error}") from None


def cpu_isa() -> str | None:
    """The ISA tier the CPU kernels run now (one of CPU_ISAS), or None without the extension."""
    return None if _native is None else _native.cpu_kernel_isa()


def supported_cpu_isas() -> list[str]:
    """The tiers this CPU and build can run, slowest first; empty without the extension."""
    return [] if _native is None else list(_native.supported_cpu_isas())


def best_cpu_isa() -> str | None:
    """The tier "auto" chooses on this CPU (not always the last of supported_cpu_isas():
    avx512_bf16 only where vdpbf16ps beats fp32 FMAs, see csrc/cpu/cpu_isa.cpp)."""
    return None if _native is None else _native.best_cpu_isa()


def set_cpu_isa(isa: str) -> None:
    """Runs the CPU kernels of tier ``isa`` ("auto": the best this CPU has) from now on.
    ValueError for a tier this CPU or build lacks."""
    if _native is None:
        raise ValueError("set_cpu_isa: the C++ extension is not built")
    _native.set_cpu_isa(isa)  # the extension's TORCH_CHECK_VALUE arrives as a ValueError


@contextmanager
def use_cpu_isa(isa: str) -> Iterator[None]:
    """Runs the block on the CPU kernels of tier ``isa``, then restores the tier before it:
    how tests and benchmarks compare tiers in one process."""
    before = cpu_isa()
    set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(before)


def amx_bf16_matmuls() -> bool:
    """Whether ``bf16_linear`` runs calls of many rows in AMX tiles now
    (csrc/cpu/linear_amx_kernel.h): a CPU with AMX (Sapphire Rapids and later Xeons) whose
    kernels run an AVX-512 tier. Forcing a lower tier (CONTBATCH_CPU_ISA, use_cpu_isa), or
    CONTBATCH_AMX=0 before import (or ``set_amx_matmuls(False)``), keeps every call on
    the vector kernel."""
    return _native is not None and bool(_native.amx_linears())


def amx_int8_matmuls() -> bool:
    """Whether int8 linears (``quantization="int8"``, 64-input blocks, the avx512_vnni int8
    kernel) of many rows run in AMX tiles now (csrc/cpu/int8_amx_kernel.h): as
    ``amx_bf16_matmuls``, on a CPU with AMX-INT8."""
    return _native is not None and bool(_native.amx_int8_linears())


def set_amx_matmuls(on: bool) -> bool:
    """Switches the AMX kernels (bf16 and int8) on or off (on changes nothing on a CPU without
    AMX); returns the setting before."""
    if _native is None:
        return False
    return bool(_native.set_amx_linears(on))


@contextmanager
def _switched(switch: Callable[[bool], bool], on: bool) -> Iterator[None]:
    """The block with ``switch`` (a setter returning the setting before) at ``on``, then the setting restored."""
    before = switch(on)
    try:
        yield
    finally:
        switch(before)


def use_amx_matmuls(on: bool) -> AbstractContextManager[None]:
    """Runs the block with the AMX kernels switched on or off, then restores the setting:
    how tests and benchmarks compare AMX with the vector kernels in one process."""
    return _switched(set_amx_matmuls, on)


def widened_bf16_panels() -> bool:
    """Whether ``bf16_linear`` runs of 2 register tiles of rows or more widen each weight
    panel to fp32 before the multiply-adds now (csrc/cpu/linear_kernel.h): on tiers without
    bf16 dot products (generic, avx2, avx512), by default on Intel CPUs only, where it was
    faster; on AMD (Zen 3) widening each weight in the loop was (csrc/cpu/cpu_isa.cpp)."""
    return _native is not None and bool(_native.widened_linears())


def set_widened_panels(on: bool) -> bool:
    """Switches the widened bf16 kernel on or off (on changes nothing on a tier with bf16 dot
    products); returns the setting before."""
    if _native is None:
        return False
    return bool(_native.set_widened_linears(on))


def use_widened_panels(on: bool) -> AbstractContextManager[None]:
    """Runs the block with the widened bf16 kernel switched on or off, then restores the
    setting: how tests run both kernels on any CPU and benchmarks compare them."""
    return _switched(set_widened_panels, on)


def bf16_linear_available() -> bool:
    """Whether ``bf16_linear`` has a compiled kernel: every ISA tier has one, so bf16
    weights take its panel layout wherever the extension is built."""
    return _native is not None


_choose_isa_from_environment()

bf16_linear = _native.bf16_linear if _native is not None else reference.bf16_linear
int8_quantize_rows = _native.int8_quantize_rows if _native is not None else reference.int8_quantize_rows
int8_linear = _native.int8_linear if _native is not None else reference.int8_linear
int8_quantize_linear = _native.int8_quantize_linear if _native is not None else reference.int8_quantize_linear


INT8_KERNELS = ("generic", "avx2", "avx_vnni", "avx512_vnni")
"""The int8 linear kernels, slowest first (csrc/cpu/int8_kernel_api.h)."""


def int8_kernel_isa() -> str | None:
    """Which int8 linear kernel runs now. By default it follows the active tier:
    "avx512_vnni" under either AVX-512 tier on a CPU with VNNI, else "avx_vnni" (256-bit
    vpdpbusd, Intel's AVX2 client CPUs) where the CPU has it, else "avx2" (vpmaddubsw), and
    "generic" under the generic tier; None without the extension."""
    return None if _native is None else _native.int8_kernel_isa()


INT8_WEIGHT_BLOCKS = {"avx512_vnni": 64}
"""Inputs a block of the weights contbatch quantizes, by int8 kernel; 32 (Q8_0's) for the
others. A 64-input block halves the kernel's per-block finish (three vector operations a
16-column accumulator), which on the AVX-512 VNNI kernel made the layers 8-10% faster at
64-256 rows on a Zen 4; the AVX2 kernel's few-row calls ran 10-20% slower with it on the AVX2
stand-in, and AVX-VNNI's was not measured (docs/performance.md, "64-input blocks")."""


def int8_weight_block() -> int:
    """The block size ``LLM(quantization="int8")`` quantizes weights in, for the int8 kernel
    that runs now (``INT8_WEIGHT_BLOCKS``); a GGUF file's Q8_0 layers keep their 32."""
    return INT8_WEIGHT_BLOCKS.get(int8_kernel_isa(), int8_blocks.Q8_0_BLOCK)


INT8_NARROW_WEIGHT_KERNELS = ("avx2",)
"""The int8 kernels ``LLM(quantization="int8")`` quantizes weights narrow for (|q| <= 64 but
the LM head's, contbatch/ops/int8_blocks.py): AVX2's multiplies them without ``vpsignb``. On a
Zen 3, SmolLM2's projections at 256 rows took 0.83x the time with every one narrow (a trial);
narrow but the LM head, as shipped, perplexity is +0.77% against bf16 rather than +0.66% with
all 8 bits. The vpdpbusd kernels run either as fast, so they keep all 8 bits."""


def int8_weight_qmax() -> int:
    """The largest |q| ``LLM(quantization="int8")`` quantizes linear layers other than the LM
    head to, for the int8 kernel that runs now: 64 on those of ``INT8_NARROW_WEIGHT_KERNELS``,
    else Q8_0's 127."""
    narrow = int8_kernel_isa() in INT8_NARROW_WEIGHT_KERNELS
    return int8_blocks.NARROW_QMAX if narrow else int8_blocks.QMAX


def supported_int8_kernels() -> list[str]:
    """The int8 kernels this CPU and build can run, slowest first; empty without the extension."""
    return [] if _native is None else list(_native.supported_int8_kernels())


@contextmanager
def use_int8_kernel(name: str) -> Iterator[None]:
    """Runs the block's int8 ops on kernel ``name`` whatever the tier ("auto": the tier's
    choice), then restores the setting before: how tests and benchmarks reach each int8
    kernel a CPU has. ValueError for one this CPU or build cannot run."""
    if _native is None:
        raise ValueError("use_int8_kernel: the C++ extension is not built")
    before = _native.set_int8_kernel(name)
    try:
        yield
    finally:
        _native.set_int8_kernel(before)

__all__ = [
    "BACKEND",
    "reshape_and_cache",
    "paged_attention",
    "copy_blocks",
    *ROW_OPS,
    "bf16_linear",
    "amx_bf16_matmuls",
    "set_amx_matmuls",
    "use_amx_matmuls",
    "set_widened_panels",
    "use_widened_panels",
    "widened_bf16_panels",
    "amx_int8_matmuls",
    "bf16_linear_available",
    "int8_quantize_rows",
    "int8_linear",
    "int8_quantize_linear",
    "int8_kernel_isa",
    "int8_weight_block",
    "int8_weight_qmax",
    "INT8_NARROW_WEIGHT_KERNELS",
    "INT8_WEIGHT_BLOCKS",
    "INT8_KERNELS",
    "supported_int8_kernels",
    "use_int8_kernel",
    "CPU_ISAS",
    "cpu_isa",
    "supported_cpu_isas",
    "best_cpu_isa",
    "set_cpu_isa",
    "use_cpu_isa",
    "reference",
]
