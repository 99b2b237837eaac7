"""Random paged KV caches and varlen batches for the op tests (layout: docs/design/kv_cache_layout.md)."""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, fields

import pytest
import torch

from contbatch import ops
from contbatch.ops import reference

# Tolerances against the reference. fp32: both accumulate in fp32, so only summation order
# differs. bf16: inputs are the same bf16 values and both accumulate in fp32, so outputs
# differ by at most about one bf16 rounding (2^-8 relative); the fp32 tests are the tight ones.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

# Every ISA tier of the CPU kernels this CPU and build can run (generic, avx2, avx512,
# avx512_bf16: whichever are here); hypothesis tests draw from these.
SUPPORTED_ISAS = tuple(ops.supported_cpu_isas()) or ("generic",)


def isa_params() -> list:
    """Every tier as a pytest parameter; those this CPU or build lacks are skipped, saying so."""
    return [
        pytest.param(isa, marks=pytest.mark.skipif(isa not in SUPPORTED_ISAS,
                                                   reason=f"this CPU or build cannot run the {isa} kernels"))
        for isa in ops.CPU_ISAS
    ]


SUPPORTED_INT8_KERNELS = tuple(ops.supported_int8_kernels())


def _amx_int8_runs_here() -> bool:
    if "avx512" not in SUPPORTED_ISAS or "avx512_vnni" not in SUPPORTED_INT8_KERNELS:
        return False
    with ops.use_cpu_isa("avx512"), ops.use_amx_matmuls(True):
        return ops.amx_int8_matmuls()


AMX_INT8 = "avx512_vnni+amx"
"""The int8 parameter for the VNNI kernel with AMX taking its calls of many rows."""
AMX_INT8_HERE = _amx_int8_runs_here()


def int8_kernel_params() -> list:
    """Every int8 kernel as a pytest parameter, each with the AMX kernel switched off, and
    AMX_INT8; those this CPU or build lacks are skipped, saying so."""
    return [
        pytest.param(kernel, marks=pytest.mark.skipif(kernel not in SUPPORTED_INT8_KERNELS,
                                                      reason=f"this CPU or build cannot run the {kernel} int8 kernel"))
        for kernel in ops.INT8_KERNELS
    ] + [pytest.param(AMX_INT8, marks=pytest.mark.skipif(
        not AMX_INT8_HERE, reason="this CPU (or its VM) exposes no AMX-INT8, or the OS refused the tile registers"))]


@contextmanager
def use_int8_kernel(kernel: str):
    """Runs the block on int8 kernel ``kernel`` (an int8_kernel_params value): AMX_INT8 is the
    VNNI kernel with AMX on, every other kernel runs with AMX off."""
    with ops.use_amx_matmuls(kernel == AMX_INT8), ops.use_int8_kernel("avx512_vnni" if kernel == AMX_INT8 else kernel):
        yield


def device_params() -> list:
    """"cpu", and "cuda" when torch sees a GPU (else skipped, saying so): the first machine
    with a GPU runs the CUDA kernels against the same references."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device: the CUDA kernels are untested here"))]


def require_native() -> None:
    """Skips the calling test module when the extension is not built."""
    try:
        from contbatch import _C  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"contbatch._C is not built ({exc}); build it with pip install -e . --no-build-isolation",
                    allow_module_level=True)


def cpu_isa(isa: str):
    """Runs the block on the CPU kernels of tier ``isa``."""
    return ops.use_cpu_isa(isa)


@contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


THREAD_COUNTS = (1, 2, 3)


def assert_same_at_every_thread_count(call: Callable[[], torch.Tensor]) -> None:
    """call() must give bit for bit the same tensor at 1, 2 and 3 threads. The engine changes
    its thread count with the machine's load (contbatch/engine/threads.py): a result that
    followed the thread count would make a greedy token depend on how busy the machine was."""
    results = {}
    for n in THREAD_COUNTS:
        with num_threads(n):
            results[n] = call()
    for n, result in results.items():
        assert torch.equal(result, results[1]), f"{n} threads give another result than 1 thread"


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries -1
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    def to(self, device: str) -> "PagedBatch":
        return PagedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def attention_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def random_batch(
    gen: torch.Generator,
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Every sequence gets its own physical blocks in shuffled order; the spare blocks and
    the cache contents past each sequence's length hold random values too, so reading a
    wrong block or slot changes the result. ``cache_dtype`` torch.int8: the caches hold the
    same random values quantized (kv_cache_dtype="int8"), rows scaled differently; else ``dtype``."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1  # one unused column of -1
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(physical[:count], dtype=torch.int32)
        physical = physical[count:]
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    def cache() -> torch.Tensor:
        values = torch.randn(shape, generator=gen)
        if cache_dtype == torch.int8:  # rows of different magnitudes, so a wrong row's scale shows
            return reference.quantize_kv_rows(values * (0.5 + torch.rand(shape[:-1] + (1,), generator=gen)))
        return values.to(dtype)

    return PagedBatch(
        query=torch.randn(starts[-1], num_heads, head_size, generator=gen).to(dtype),
        key_cache=cache(),
        value_cache=cache(),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )


def run_both(batch: PagedBatch, scale: float, sliding_window: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(compiled, reference) paged_attention outputs; the compiled one starts NaN-filled so
    unwritten rows fail."""
    expected = torch.zeros_like(batch.query)
    reference.paged_attention(expected, *batch.attention_args(), scale, sliding_window)
    out = torch.full_like(batch.query, float("nan"))
    with cpu_isa(isa):
        torch.ops.contbatch.paged_attention(out, *batch.attention_args(), scale, sliding_window)
    return out, expected
