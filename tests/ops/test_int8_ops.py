"""The int8 ops (csrc/cpu/int8_*) against the PyTorch reference (contbatch/ops/int8_blocks.py)
on every int8 kernel this CPU runs (ops.use_int8_kernel: AVX-512 VNNI, AVX-VNNI, AVX2's
vpmaddubsw, portable C++; each with AMX off, and the VNNI kernel with AMX taking its calls of
16 rows or more where the CPU has AMX-INT8), and the rule that picks one for each ISA tier:

Each in both block sizes the kernels serve (32 inputs: a GGUF file's Q8_0; 64: what
contbatch quantizes with):

- activation quantization: bit for bit, fp32 and bf16 rows, ragged last blocks;
- the linear op: exact integer block sums (small values and unit scales make every fp32
  sum exact, so any lost or saturated product shows), and on random shapes within fp32
  rounding of the float64 reference;
- weight quantization round trip: each element within half a step of its block's scale.

Weights of both kinds the kernels take: stored q + 128 (|q| <= 128), and narrow, stored q + 64
(|q| <= 64), which AVX2's kernel reads another way (csrc/cpu/simd_int8_avx2.h).
"""

import os
import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch import ops
from contbatch.ops import int8_blocks, reference
from contbatch.ops.int8_blocks import BLOCK_SIZES, Int8Blocks, pack_int8, quantize_weight, unpack_int8
from tests.ops.paged_batch import (
    SUPPORTED_INT8_KERNELS,
    assert_same_at_every_thread_count,
    cpu_isa,
    int8_kernel_params,
    num_threads,
    require_native,
    use_int8_kernel,
)

require_native()

native = torch.ops.contbatch
DTYPES = [torch.float32, torch.bfloat16]
QMAXES = [int8_blocks.QMAX, int8_blocks.NARROW_QMAX]  # the weights' largest |q|: all 8 bits, narrow


def _linear(x: Int8Blocks, weight: Int8Blocks, bias, dtype, kernel, narrow: bool = False) -> torch.Tensor:
    packed = pack_int8(weight, narrow)
    out = torch.full((x.values.shape[0], packed.out_features), float("nan"), dtype=dtype)
    inputs = x.values.clone()
    with use_int8_kernel(kernel):
        native.int8_linear(out, x.values, x.scales, packed.values, packed.scales, bias, packed.offset)
    assert not out.isnan().any(), "an output element was never written"
    # The op stages what its kernel reads (the block offsets) beside its argument.
    assert torch.equal(x.values, inputs), "int8_linear changed its x_values"
    return out


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), in_features=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_quantize_rows_equals_reference(kernel, dtype, block, rows, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
    x[0, : min(in_features, block)] = 0  # an all-zero block: scale 0, values 0
    with use_int8_kernel(kernel):
        values, scales = native.int8_quantize_rows(x, block)
    expected = int8_blocks.quantize_activations(x, block)
    assert values.shape[1] % block == 0 and scales.shape[1] == values.shape[1] // block
    assert torch.equal(values, expected.values)
    assert torch.equal(scales, expected.scales)


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("narrow", [False, True])
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 60),
    out_features=st.integers(1, 150),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_integer_sums_are_exact(kernel, block, narrow, rows, out_features, blocks, seed):
    """Values up to +-127 on one side and +-15 on the other keep every sum below 2^24, where
    fp32 holds integers exactly: the kernel must give the int64 matmul bit for bit, for
    weights stored either way."""
    g = torch.Generator().manual_seed(seed)
    in_features = blocks * block
    x_values = torch.randint(-127, 128, (rows, in_features), generator=g, dtype=torch.int8)
    w_values = torch.randint(-15, 16, (out_features, in_features), generator=g, dtype=torch.int8)
    x = Int8Blocks(x_values, torch.ones(rows, blocks), in_features)
    weight = Int8Blocks(w_values, torch.ones(out_features, blocks, dtype=torch.float16), in_features)
    out = _linear(x, weight, None, torch.float32, kernel, narrow)
    expected = x_values.long() @ w_values.long().T
    assert torch.equal(out, expected.float())


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("narrow", [False, True])
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), out_features=st.integers(1, 130), seed=st.integers(0, 2**31 - 1))
def test_linear_extreme_products_are_exact(kernel, block, narrow, rows, out_features, seed):
    """Every product at the largest magnitude a kernel meets: inputs +-127 (as quantized) and
    weights at their ends, signs at random, so neighbouring products often share a sign:
    AVX2's vpmaddubsw adds pairs into saturating int16 lanes and must not clip one. Weights
    stored q + 128 at 127 or -128 (a GGUF file's Q8_0 may hold -128); narrow ones at 64 or -64
    (stored 128 and 0, which AVX2 multiplies as they are: a pair of 2 x 128 x 127 = 32,512
    before the offset takes 64 x the inputs out). 1,024 inputs keep every sum (at most 1,024 x
    127 x 128) below 2^24."""
    g = torch.Generator().manual_seed(seed)
    in_features = 1024
    blocks = in_features // block
    low, high = (-64, 64) if narrow else (-128, 127)
    x_values = (torch.randint(0, 2, (rows, in_features), generator=g) * 254 - 127).to(torch.int8)
    w_values = (torch.randint(0, 2, (out_features, in_features), generator=g) * (high - low) + low).to(torch.int8)
    x = Int8Blocks(x_values, torch.ones(rows, blocks), in_features)
    weight = Int8Blocks(w_values, torch.ones(out_features, blocks, dtype=torch.float16), in_features)
    out = _linear(x, weight, None, torch.float32, kernel, narrow)
    assert torch.equal(out, (x_values.long() @ w_values.long().T).float())


def test_narrow_packing_refuses_weights_past_64():
    weight = Int8Blocks(torch.full((3, 32), 65, dtype=torch.int8), torch.ones(3, 1, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match=r"narrow weights must lie in \[-64, 64\], got \|q\| up to 65"):
        pack_int8(weight, narrow=True)


@pytest.mark.parametrize("op", ["int8_linear", "int8_quantize_linear"])
def test_weight_offsets_the_kernels_do_not_know_are_refused(op):
    packed = pack_int8(quantize_weight(torch.randn(4, 32)))
    out = torch.empty(2, 4)
    x = torch.randn(2, 32)
    inputs = native.int8_quantize_rows(x, 32) if op == "int8_linear" else (x,)
    with pytest.raises(ValueError, match=f"{op}: weight_offset must be 128 or 64 \\(narrow weights\\), got 100"):
        getattr(native, op)(out, *inputs, packed.values, packed.scales, None, 100)


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("qmax", QMAXES)
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 60),
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 200),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_matches_reference(kernel, dtype, block, qmax, rows, out_features, in_features, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = quantize_weight(torch.randn(out_features, in_features, generator=g) * 0.2, block, qmax)
    narrow = qmax == int8_blocks.NARROW_QMAX
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x_blocks = int8_blocks.quantize_activations(x, block)
    ours = _linear(x_blocks, weight, bias, dtype, kernel, narrow)
    expected = int8_blocks.int8_linear_reference(x_blocks, weight, bias)
    # fp32 sums over blocks in another order; bf16 output: one rounding step more.
    rtol, atol = (2**-7, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-5 * in_features)
    torch.testing.assert_close(ours.double(), expected, rtol=rtol, atol=atol)
    # The fused op the layers call: the same quantization (bit for bit, above) and kernel.
    packed = pack_int8(weight, narrow)
    fused = torch.full_like(ours, float("nan"))
    with use_int8_kernel(kernel):
        native.int8_quantize_linear(fused, x, packed.values, packed.scales, bias, packed.offset)
    assert torch.equal(fused, ours)
    reference.int8_quantize_linear(fused, x, packed.values, packed.scales, bias, packed.offset)
    torch.testing.assert_close(fused.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("qmax", QMAXES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 20, 32, 47, 48, 49, 101])
def test_linear_row_tiles_and_tasks(kernel, block, qmax, rows):
    """Row counts around the register tiles (2 to 6 rows, split evenly: 20 rows as 5, 5, 5, 5),
    the calls whose tiles span the panel (up to 10 rows in tiles of up to 4 on the VNNI kernel,
    those of 4 rows with their fp32 sums in L1: 7 rows as 4, 3; up to 10 rows in tiles of up to
    2 on AVX2), the 48-row task; SmolLM2's width."""
    g = torch.Generator().manual_seed(rows)
    x = int8_blocks.quantize_activations(torch.randn(rows, 576, generator=g), block)
    weight = quantize_weight(torch.randn(130, 576, generator=g) * 0.05, block, qmax)
    ours = _linear(x, weight, None, torch.float32, kernel, narrow=qmax == int8_blocks.NARROW_QMAX)
    expected = int8_blocks.int8_linear_reference(x, weight, None)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("rows", [1, 7, 12, 17, 33, 40, 100])
def test_fused_op_is_the_same_at_every_thread_count(kernel, rows):
    """The threads split a call into runs of rows of a panel (panel_runs.h), and the kernels
    take other tiles (and AVX2 a widened panel) for runs of other sizes: a row's result must
    not depend on the run it fell in."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    packed = pack_int8(quantize_weight(torch.randn(960, 576, generator=g) * 0.05, ops.int8_weight_block()))

    def call() -> torch.Tensor:
        out = torch.empty(rows, 960, dtype=torch.bfloat16)
        with use_int8_kernel(kernel):
            native.int8_quantize_linear(out, x, packed.values, packed.scales, None)
        return out

    assert_same_at_every_thread_count(call)


@pytest.mark.parametrize("kernel", int8_kernel_params())
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("qmax", QMAXES)
def test_fused_op_equals_quantizing_first_however_its_threads_stage(kernel, threads, qmax):
    """The fused op's threads each quantize and stage a call's rows themselves from 3 rows up
    to a count that falls with the thread count (256 rows on two threads, 128 on three), and
    read one staging otherwise; either way the result is int8_quantize_rows then
    int8_linear's, bit for bit, at counts on both sides of each limit."""
    g = torch.Generator().manual_seed(threads)
    weight = quantize_weight(torch.randn(130, 576, generator=g) * 0.05, 64, qmax)
    packed = pack_int8(weight, narrow=qmax == int8_blocks.NARROW_QMAX)
    for rows in (1, 2, 3, 9, 16, 17, 128, 129, 256, 257, 300):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        fused = torch.full((rows, 130), float("nan"), dtype=torch.bfloat16)
        unfused = torch.full((rows, 130), float("nan"), dtype=torch.bfloat16)
        with use_int8_kernel(kernel), num_threads(threads):
            native.int8_quantize_linear(fused, x, packed.values, packed.scales, None, packed.offset)
            x_values, x_scales = native.int8_quantize_rows(x, 64)
            native.int8_linear(unfused, x_values, x_scales, packed.values, packed.scales, None, packed.offset)
        assert not unfused.isnan().any(), f"{rows} rows: an output element was never written"
        assert torch.equal(fused, unfused), f"{rows} rows on {threads} threads"


@pytest.mark.parametrize("kernel", int8_kernel_params())
def test_fused_op_stages_small_and_large_calls_alike(kernel):
    """The fused op stages a call's inputs in a buffer its thread keeps (up to 1 MiB) or, for a
    larger call (700 rows of 1,536 inputs), in memory of its own; calls of other sizes in
    between must not see each other's staging."""
    g = torch.Generator().manual_seed(7)
    weight = quantize_weight(torch.randn(70, 1536, generator=g) * 0.05, 64)
    packed = pack_int8(weight)
    for rows in (3, 700, 1, 700, 5):
        x = torch.randn(rows, 1536, generator=g).to(torch.bfloat16)
        x_blocks = int8_blocks.quantize_activations(x, 64)
        fused = torch.full((rows, 70), float("nan"), dtype=torch.bfloat16)
        with use_int8_kernel(kernel):
            native.int8_quantize_linear(fused, x, packed.values, packed.scales, None)
        assert torch.equal(fused, _linear(x_blocks, weight, None, torch.bfloat16, kernel)), f"{rows} rows"
        expected = int8_blocks.int8_linear_reference(x_blocks, weight, None)
        torch.testing.assert_close(fused.double(), expected, rtol=2**-7, atol=1e-3)


def test_quantize_linear_refuses_inputs_the_weight_does_not_take():
    weight = pack_int8(quantize_weight(torch.randn(8, 64), 32))  # 2 blocks: 33 to 64 inputs
    with pytest.raises(ValueError, match="input has 96 features, the weight's 2 blocks of 32 take 33 to 64"):
        native.int8_quantize_linear(torch.empty(2, 8), torch.randn(2, 96), weight.values, weight.scales, None)


def test_quantize_linear_refuses_mismatched_rows_and_dtypes():
    weight = pack_int8(quantize_weight(torch.randn(8, 32)))
    args = (weight.values, weight.scales, None)
    with pytest.raises(ValueError, match="same rows"):
        native.int8_quantize_linear(torch.empty(3, 8), torch.randn(2, 32), *args)
    with pytest.raises(TypeError, match="one dtype"):
        native.int8_quantize_linear(torch.empty(2, 8), torch.randn(2, 32, dtype=torch.bfloat16), *args)


def test_block_sizes_the_kernels_do_not_serve_are_refused():
    with pytest.raises(ValueError, match="block must be 32 or 64, got 48"):
        native.int8_quantize_rows(torch.randn(2, 96), 48)
    with pytest.raises(ValueError, match=r"block must be one of \(32, 64\), got 16"):
        quantize_weight(torch.randn(4, 32), 16)
    with pytest.raises(ValueError, match=r"qmax must be 127 or 64 \(narrow weights\), got 100"):
        quantize_weight(torch.randn(4, 32), 32, 100)
    weight = pack_int8(quantize_weight(torch.randn(8, 96), 32))
    as_16 = weight.values.view(weight.values.shape[0], -1, 4, 64, 4)  # 16-input blocks, as the kernels see them
    with pytest.raises(ValueError, match="blocks of 32 or 64 inputs"):
        native.int8_quantize_linear(torch.empty(2, 8), torch.randn(2, 96), as_16, weight.scales, None)


def test_the_reference_refuses_activations_in_other_blocks_than_the_weight():
    x = int8_blocks.quantize_activations(torch.randn(2, 64), 32)
    with pytest.raises(ValueError, match="activations in blocks of 32, weight in blocks of 64"):
        int8_blocks.int8_linear_reference(x, quantize_weight(torch.randn(4, 64), 64), None)


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("qmax", QMAXES)
@settings(max_examples=50, deadline=None)
@given(out_features=st.integers(1, 70), in_features=st.integers(1, 100), seed=st.integers(0, 2**31 - 1))
def test_weight_round_trip_within_half_a_step(block, qmax, out_features, in_features, seed):
    """Each element within half a step of its block's scale s, except where rounding s to
    fp16 made 127 * s smaller than the block's largest value: there the clamped elements are
    off by at most that difference (at most 2^-11 of it for normal fp16 scales).

    "Half a step" up to the fp32 rounding of w * (1 / s), as the kernels compute it: the
    reciprocal and the product are each off by up to 2^-24 relative, so w / s (|w / s| <= 128)
    lands up to 128 * 2^-23 from where it is, and an element just under half a step from a
    value can round to it (found by hypothesis: 0.500008 steps off). Dequantizing adds one
    more fp32 rounding (2^-24 of |w| <= 128 * s)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)
    blocks = quantize_weight(weight, block, qmax)
    assert blocks.block == block
    assert blocks.values.abs().max() <= qmax
    narrow = qmax == int8_blocks.NARROW_QMAX
    assert torch.equal(unpack_int8(pack_int8(blocks, narrow)).values, blocks.values), "packing must be lossless"
    padded = torch.nn.functional.pad(weight, (0, blocks.values.shape[1] - in_features)).view(out_features, -1, block)
    error = (blocks.dequantize() - weight).abs()
    error = torch.nn.functional.pad(error, (0, blocks.values.shape[1] - in_features)).view(out_features, -1, block)
    step = blocks.scales.float()
    clamped_by = (padded.abs().amax(-1) - qmax * step).clamp(min=0)
    bound = torch.maximum(0.5 * step, clamped_by) + 3 * 128 * 2**-24 * step + 1e-12
    assert (error <= bound.unsqueeze(-1)).all()
    normal = step >= 2**-14  # fp16's smallest normal
    assert (clamped_by[normal] <= qmax * step[normal] * 2**-11 * (1 + 2**-10)).all()


def test_ops_wrappers_take_the_extension():
    assert ops.int8_linear is native.int8_linear and ops.int8_quantize_rows is native.int8_quantize_rows
    assert ops.int8_quantize_linear is native.int8_quantize_linear


def _best_of(*kernels: str) -> str:
    return next(k for k in kernels if k in SUPPORTED_INT8_KERNELS)


def test_each_tier_runs_the_best_int8_kernel_the_cpu_has():
    expected = {
        "generic": "generic",
        "avx2": _best_of("avx_vnni", "avx2"),
        "avx512": _best_of("avx512_vnni", "avx_vnni", "avx2"),
        "avx512_bf16": _best_of("avx512_vnni", "avx_vnni", "avx2"),
    }
    # "auto" first: CONTBATCH_INT8_KERNEL may have forced a kernel for this process.
    with ops.use_int8_kernel("auto"):
        for isa in ops.supported_cpu_isas():
            with cpu_isa(isa):
                assert ops.int8_kernel_isa() == expected[isa], isa
                with ops.use_int8_kernel("generic"):
                    assert ops.int8_kernel_isa() == "generic"
                    with ops.use_int8_kernel("auto"):
                        assert ops.int8_kernel_isa() == expected[isa]
                    assert ops.int8_kernel_isa() == "generic", "a nested use_int8_kernel did not restore the outer one"
                assert ops.int8_kernel_isa() == expected[isa], "use_int8_kernel did not hand the choice back"


def test_a_kernel_the_cpu_cannot_run_is_refused_naming_those_it_can():
    with pytest.raises(ValueError, match="cannot run the int8 kernel 'avx9'; it can run: auto, generic"):
        with ops.use_int8_kernel("avx9"):
            pass


def _int8_kernel_in_a_fresh_process(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTBATCH_INT8_KERNEL": value}
    return subprocess.run([sys.executable, "-c", "from contbatch import ops; print(ops.int8_kernel_isa())"],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kernel", SUPPORTED_INT8_KERNELS)
def test_the_environment_variable_chooses_the_int8_kernel_at_import(kernel):
    run = _int8_kernel_in_a_fresh_process(kernel)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == kernel


def test_an_int8_kernel_in_the_environment_the_cpu_cannot_run_is_refused_at_import():
    run = _int8_kernel_in_a_fresh_process("avx9")
    assert run.returncode != 0
    assert "CONTBATCH_INT8_KERNEL=avx9" in run.stderr
    assert "it can run: auto, generic" in run.stderr
