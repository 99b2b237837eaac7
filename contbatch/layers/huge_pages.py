"""Packed weights, in the order the layers read them, on 2 MiB pages (Linux).

A decode step with few requests running reads every weight once, straight from DRAM. On 4
KiB pages that stream takes a TLB miss every 4 KiB, and the hardware prefetcher, which does
not cross a page, starts again at each one. Linux backs memory with 2 MiB pages where it is
advised to (``madvise(MADV_HUGEPAGE)``; transparent huge pages in their default ``madvise``
mode), but only for 2 MiB-aligned ranges that one allocation covers, and most projections are
smaller than that (SmolLM2's largest int8 one is 1.8 MB). So the packed weights are copied,
one after another, into a single buffer advised before its first touch, and each tensor is
re-pointed at its copy in place (``Tensor.set_``): every holder (the modules, the C++
decoder stack, an int8 table shared by the head and the lookup) sees the move.

SmolLM2 on a Zen 4 (2 threads, 2026-11-27; benchmarks/decode_steps.py and chat256, both
ways alternated in one session): decode steps with 1-8 running 5-7% faster in bf16 and 2-9%
with int8 weights; chat256 4-6% (bf16) and 7% (int8) more output tok/s (then with the KV
cache on huge pages as well). The cost: moving SmolLM2's 269 MB takes 0.25-0.5 s at load
(this VM backs a fresh huge page slowly). The KV cache was on such pages too until
2026-12-02; it is written for the first time while requests run, where that slow backing
cost more than the pages saved (contbatch/engine/kv_cache.py, ``KVCacheSpec.allocate``).
``CONTBATCH_HUGE_PAGES=0`` turns the move off, to compare.
"""

import mmap
import os
import sys

import torch
from torch import nn

from contbatch.layers.linear import PackedWeight
from contbatch.ops.int8_blocks import PackedInt8

HUGE_PAGE_BYTES = 2 << 20
_ALIGNMENT = 64  # each tensor starts on a cache line, as the allocator would place it


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("CONTBATCH_HUGE_PAGES", "1") != "0"


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every packed weight's tensors (a ``PackedWeight`` or ``PackedInt8`` held by any module),
    in module order, which is the order a forward pass reads them; each storage once."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            for tensor in weight_tensors(value):
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    tensors.append(tensor)
    return tensors


def weight_tensors(value: object) -> list[torch.Tensor]:
    """The tensors holding a ``PackedWeight``'s or ``PackedInt8``'s bytes (none for oneDNN's
    opaque ones or any other value)."""
    if isinstance(value, PackedWeight):
        value = value.data
        # oneDNN's packed weights are opaque tensors (layout torch._mkldnn): no bytes to move.
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            return [value]
    if isinstance(value, PackedInt8):
        return [value.values, value.scales]
    return []


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Copies the CPU tensors among ``tensors`` (contiguous, strided) into one buffer advised
    onto huge pages and points each at its copy; returns the bytes moved (0 where the
    platform or ``CONTBATCH_HUGE_PAGES=0`` rules it out). The originals are freed as they go,
    so the peak is about one tensor above the weights' own size."""
    movable = [t for t in tensors if t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()]
    if not movable or not enabled():
        return 0
    sizes = [_round_up(t.numel() * t.element_size(), _ALIGNMENT) for t in movable]
    arena = _advised_buffer(sum(sizes))
    if arena is None:
        return 0
    offset = 0
    with torch.inference_mode():  # packed weights may be inference tensors
        for tensor, size in zip(movable, sizes):
            nbytes = tensor.numel() * tensor.element_size()
            copy = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            tensor.set_(copy)
            offset += size
    return offset


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def _advised_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 buffer of ``nbytes`` starting on a huge page boundary, in fresh anonymous memory
    (never touched: malloc could hand back pages already backed by 4 KiB ones) advised
    MADV_HUGEPAGE; None where madvise refuses (a kernel without transparent huge pages). The
    tensor keeps the mapping alive."""
    advised = _round_up(nbytes, HUGE_PAGE_BYTES)
    # Private: a shared anonymous mapping is shmem, whose huge pages are a separate setting.
    memory = mmap.mmap(-1, advised + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # < 2 MiB, so the advised range stays inside
    try:
        memory.madvise(mmap.MADV_HUGEPAGE, start, advised)
    except (AttributeError, OSError):
        return None
    return raw[start : start + nbytes]
