"""contbatch::reshape_and_cache and contbatch::copy_blocks (csrc/cpu/cache.cpp) against the reference."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch import ops
from contbatch.ops import reference
from tests.ops.paged_batch import SUPPORTED_INT8_KERNELS, device_params, require_native

require_native()

DTYPES = [torch.float32, torch.bfloat16]


@settings(max_examples=80, deadline=None)
@given(
    cache_dtype=st.sampled_from([*DTYPES, torch.int8]),
    input_dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([8, 16, 32]),
    num_kv_heads=st.integers(1, 4),
    head_size=st.sampled_from([16, 64, 80, 96, 128, 256]),
    num_blocks=st.integers(1, 12),
    num_tokens=st.integers(0, 40),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    int8_kernel=st.sampled_from(SUPPORTED_INT8_KERNELS or ("auto",)),
)
def test_reshape_and_cache_matches_reference(
    cache_dtype, input_dtype, block_size, num_kv_heads, head_size, num_blocks, num_tokens, strided, seed, int8_kernel
):
    """Bit for bit. An int8 cache (kv_cache_dtype="int8") rounds x * (127 / max|x|) half to
    even in fp32 like the reference, ties included (half the tokens are small halves, which
    make exact ties common), in the int8 kernels' code: each kernel this CPU has runs."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    num_tokens = min(num_tokens, num_slots)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    skipped = torch.rand(num_tokens, generator=gen) < 0.2
    slot_mapping = torch.where(skipped, -1, slots).long()
    # strided: key and value are views into one fused [num_tokens, 2 * num_kv_heads, head] tensor
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_size, generator=gen)
    kv[num_tokens // 2 :] = torch.randint(-8, 9, kv[num_tokens // 2 :].shape, generator=gen) / 2
    kv = kv.to(input_dtype)
    if strided:
        key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    else:
        key, value = kv[:, :num_kv_heads].contiguous(), kv[:, num_kv_heads:].contiguous()
    int8 = cache_dtype == torch.int8
    shape = (num_blocks, num_kv_heads, block_size, head_size + (reference.KV_INT8_SCALE_BYTES if int8 else 0))
    if int8:
        key_cache, value_cache = (torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8) for _ in "kv")
    else:
        key_cache, value_cache = (torch.randn(shape, generator=gen).to(cache_dtype) for _ in "kv")
    expected_k, expected_v = key_cache.clone(), value_cache.clone()

    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    with ops.use_int8_kernel(int8_kernel):
        torch.ops.contbatch.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reshape_and_cache_rejects_bad_input():
    cache = torch.zeros(2, 1, 4, 64)
    key = torch.zeros(3, 1, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        torch.ops.contbatch.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 8]))
    with pytest.raises(TypeError, match="int64"):
        torch.ops.contbatch.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2]).int())
    with pytest.raises(ValueError, match="entries"):
        torch.ops.contbatch.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="key must be"):
        torch.ops.contbatch.reshape_and_cache(key[..., :32], key[..., :32], cache, cache.clone(),
                                              torch.tensor([0, 1, 2]))
    assert (cache == 0).all()


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 3),
    num_blocks=st.integers(2, 16),
    num_pairs=st.integers(0, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_copy_blocks_matches_reference(dtype, num_layers, num_blocks, num_pairs, seed):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen)
    num_pairs = min(num_pairs, num_blocks // 2)
    src, dst = order[:num_pairs], order[num_blocks - num_pairs:]  # disjoint, as the engine's are
    mapping = torch.stack([src, dst], dim=1).long().reshape(-1, 2)
    shape = (num_blocks, 2, 8, 64)
    key_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    value_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]

    reference.copy_blocks(expected_k, expected_v, mapping)
    torch.ops.contbatch.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "pairs, message",
    [
        ([[0, 1], [2, 1]], "appears twice"),
        ([[0, 1], [1, 2]], "both a source and a destination"),
        ([[0, 4]], "outside"),
        ([[-1, 2]], "outside"),
    ],
)
def test_copy_blocks_rejects_bad_mapping(pairs, message):
    caches = [torch.zeros(4, 1, 8, 64)]
    with pytest.raises(ValueError, match=message):
        torch.ops.contbatch.copy_blocks(caches, [torch.zeros(4, 1, 8, 64)], torch.tensor(pairs))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_ops_on_device(device, dtype):
    """reshape_and_cache then copy_blocks on each device's kernels (CUDA: csrc/cuda/cache.cu)
    against the reference on the CPU: every byte equal."""
    gen = torch.Generator().manual_seed(5)
    shape = (10, 2, 16, 64)
    key_cache, value_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    key, value = (torch.randn(20, 2, 64, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(10 * 16, generator=gen)[:20].long()
    slots[3] = -1
    mapping = torch.tensor([[1, 7], [4, 2]])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    reference.copy_blocks([expected_k], [expected_v], mapping)
    k, v = key_cache.to(device), value_cache.to(device)
    torch.ops.contbatch.reshape_and_cache(key.to(device), value.to(device), k, v, slots.to(device))
    torch.ops.contbatch.copy_blocks([k], [v], mapping)  # the engine's mapping stays on the CPU
    assert torch.equal(k.cpu(), expected_k) and torch.equal(v.cpu(), expected_v)


def test_ops_registered_for_cpu():
    for op in ("reshape_and_cache", "paged_attention", "copy_blocks"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"contbatch::{op}", "CPU"), op
