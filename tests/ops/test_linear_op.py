"""The bf16 linear op (csrc/cpu/linear*.{cpp,h}) against its PyTorch reference on random
shapes: row counts around the 6-row register tile and the 48-row task, output counts
around the 64-column panel, odd and even input counts, with and without bias, every ISA
tier this CPU runs (with the AMX kernel off), the widened kernel of the tiers without bf16 dot
products whatever the CPU's default, and on CPUs with AMX the AMX kernel
(csrc/cpu/linear_amx_kernel.h) on its own shapes. The two sum in a different order, so they
agree to one bf16 rounding step."""

import os
import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch import ops
from contbatch.ops import reference
from contbatch.ops.panel_layout import PANEL_COLUMNS, pack_panels, unpack_panels
from tests.ops.paged_batch import assert_same_at_every_thread_count, cpu_isa, isa_params, num_threads, require_native

require_native()

native = torch.ops.contbatch


def _random(shape, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)


def _amx_runs_here() -> bool:
    if "avx512" not in ops.supported_cpu_isas():
        return False
    with cpu_isa("avx512"), ops.use_amx_matmuls(True):
        return ops.amx_bf16_matmuls()


AMX_HERE = _amx_runs_here()
amx_only = pytest.mark.skipif(not AMX_HERE, reason="this CPU (or its VM) exposes no AMX-BF16, or the OS refused "
                                                   "the tile registers, or the build lacks the AMX kernel")


# Tiers whose bf16 linear has a widened kernel (KernelSet::widened_linear): no bf16 dot products.
WIDENING_ISAS = ("generic", "avx2", "avx512")


def _run_both(x, weight, bias, isa, use_amx=False, widened=False):
    packed = pack_panels(weight)
    rows, out_features = x.shape[0], weight.shape[0]
    ours = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
    expected = torch.empty(rows, out_features, dtype=torch.bfloat16)
    reference.bf16_linear(expected, x, packed, bias)
    with cpu_isa(isa), ops.use_amx_matmuls(use_amx), ops.use_widened_panels(widened):
        native.bf16_linear(ours, x, packed, bias)
    return ours, expected


def assert_within_one_rounding(ours: torch.Tensor, expected: torch.Tensor, in_features: int) -> None:
    assert not ours.isnan().any(), "an output element was never written"
    # fp32 sums in another order differ by ~in_features ulps of fp32; rounding to bf16
    # then moves a result by at most one bf16 step (2^-8 relative).
    torch.testing.assert_close(ours.float(), expected.float(), rtol=2**-7, atol=1e-5 * in_features)


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 60),
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 100),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bf16_linear_matches_reference(isa, rows, out_features, in_features, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = _random((rows, in_features), g), _random((out_features, in_features), g, 0.2)
    bias = _random((out_features,), g) if with_bias else None
    ours, expected = _run_both(x, weight, bias, isa)
    assert_within_one_rounding(ours, expected, in_features)


@pytest.mark.parametrize("widened", [False, True], ids=["direct", "widened"])
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("rows", [1, 4, 6, 11, 49, 101])
def test_bf16_linear_on_model_shapes(rows, isa, widened):
    g = torch.Generator().manual_seed(rows)
    x, weight = _random((rows, 576), g), _random((960, 576), g, 0.05)
    ours, expected = _run_both(x, weight, None, isa, widened=widened)
    assert_within_one_rounding(ours, expected, 576)


def _kernels() -> list:
    """(isa, kernel) for every tier's vector kernel with AMX and widening off, the widened
    kernel of the tiers that have one, and the avx512 tier's AMX kernel where it runs."""
    tiers = [(p.values[0], p.marks) for p in isa_params()]
    return ([pytest.param(isa, "vector", marks=marks, id=isa) for isa, marks in tiers]
            + [pytest.param(isa, "widened", marks=marks, id=f"{isa}+widened") for isa, marks in tiers
               if isa in WIDENING_ISAS]
            + [pytest.param("avx512", "amx", marks=amx_only, id="avx512+amx")])


def _order_sensitive(rows: int, out_features: int, in_features: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) whose products at inputs 4j and 4j + 2 are large and cancel (+E, then -E)
    while the others are small: where a small product is added, before or after a large one,
    changes the fp32 sum by more than a bf16 step in about one output in ten. Random inputs
    hide a change of summation order in the rounding to bf16 almost always."""
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    pairs = x[:, 2::4].shape[1]  # inputs 4j + 2, each cancelling input 4j
    big = torch.randn(rows, pairs, generator=generator) * 2**12
    x[:, 0 : 4 * pairs : 4], x[:, 2::4] = big, -big
    weight[:, 2::4] = weight[:, 0 : 4 * pairs : 4]
    return x.to(torch.bfloat16), weight.to(torch.bfloat16)


def _bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, isa: str, kernel: str) -> torch.Tensor:
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    with cpu_isa(isa), ops.use_amx_matmuls(kernel == "amx"), ops.use_widened_panels(kernel == "widened"):
        native.bf16_linear(out, x, packed, None)
    return out


@pytest.mark.parametrize("kernel", ["vector", "widened"])
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("rows", [5, 12, 17, 40])
def test_a_rows_result_does_not_depend_on_the_rows_called_with_it(isa, rows, kernel):
    """One call of all the rows against one call a row, on each tier's vector kernel (AMX, which
    takes calls of 5 rows or more, sums in its own order): with the widened kernel on, tiers
    without bf16 dot products widen the panel for runs of 2 row tiles or more and run single
    rows on the direct loop, and both loops must add the products in the same order. Before, the widened
    loop added each pair's even product first and the direct one its odd product: on the
    generic, AVX2 and AVX-512 tiers a row came out differently beside other rows."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = _order_sensitive(rows, 130, 576, gen)
    packed = pack_panels(weight)
    together = _bf16_linear(x, packed, 130, isa, kernel)
    with num_threads(1):
        alone = torch.cat([_bf16_linear(x[r : r + 1], packed, 130, isa, kernel) for r in range(rows)])
    assert torch.equal(together, alone)


def test_widened_kernel_runs_by_default_on_intel_only():
    """cpu_isa.cpp's rule: widening each panel first was faster on Intel (Emerald Rapids), the
    direct kernel on AMD (Zen 3); tiers with bf16 dot products have no widened kernel."""
    with open("/proc/cpuinfo") as cpuinfo:
        vendor = next((line.split(":")[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    widens = ops.cpu_isa() in WIDENING_ISAS and vendor == "GenuineIntel"
    assert ops.widened_bf16_panels() == widens
    with ops.use_widened_panels(not widens):
        assert ops.widened_bf16_panels() == (not widens and ops.cpu_isa() in WIDENING_ISAS)
    assert ops.widened_bf16_panels() == widens


@pytest.mark.parametrize("isa, kernel", _kernels())
@pytest.mark.parametrize("rows", [1, 12, 17, 40, 100])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 576), (200, 75)])
def test_bf16_linear_is_the_same_at_every_thread_count(isa, kernel, rows, out_features, in_features):
    """The threads split a call into runs of rows of a panel (panel_runs.h), so the rows of a
    panel at a thread's boundary run in a shorter call of the kernel than at 1 thread."""
    gen = torch.Generator().manual_seed(rows + out_features)
    x, weight = _order_sensitive(rows, out_features, in_features, gen)
    packed = pack_panels(weight)
    assert_same_at_every_thread_count(lambda: _bf16_linear(x, packed, out_features, isa, kernel))


@pytest.mark.parametrize("isa", isa_params())
def test_bf16_linear_reads_strided_rows(isa):
    g = torch.Generator().manual_seed(0)
    wide, weight = _random((9, 100), g), _random((70, 64), g)
    x = wide[:, 10:74]  # rows 100 elements apart
    ours, expected = _run_both(x, weight, None, isa)
    assert_within_one_rounding(ours, expected, 64)


@amx_only
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(5, 300),
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 40).map(lambda tiles: 32 * tiles),
    with_bias=st.booleans(),
    row_gap=st.sampled_from([0, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_amx_bf16_linear_matches_reference(rows, out_features, in_features, with_bias, row_gap, seed):
    """Calls the AMX kernel takes (5 rows or more, inputs a multiple of 32): blocks of up to
    16 rows and of 32, a partial last block (zero-padded), calls past its 256-row run, inputs
    past its 512-input pass, partial panels, and rows `row_gap` elements apart beyond their end."""
    g = torch.Generator().manual_seed(seed)
    wide = _random((rows, in_features + row_gap), g)
    x, weight = wide[:, :in_features], _random((out_features, in_features), g, 0.2)
    bias = _random((out_features,), g) if with_bias else None
    ours, expected = _run_both(x, weight, bias, "avx512", use_amx=True)
    assert_within_one_rounding(ours, expected, in_features)


def test_amx_runs_where_the_cpu_has_it():
    """On with AMX-TILE and AMX-BF16 (and an AVX-512 tier), off below the AVX-512 tiers, and
    CONTBATCH_AMX=0 at import switches it off."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next((line for line in cpuinfo if line.startswith("flags")), "").split())
    assert AMX_HERE == ({"amx_bf16", "amx_tile", "avx512_bf16"} <= flags)
    below = [isa for isa in ops.supported_cpu_isas() if isa in ("generic", "avx2")]
    with cpu_isa(below[-1]), ops.use_amx_matmuls(True):
        assert not ops.amx_bf16_matmuls(), "a forced lower tier keeps bf16 linears on its own kernel"
    with ops.use_amx_matmuls(False):
        assert not ops.amx_bf16_matmuls()
    env = {**os.environ, "CONTBATCH_AMX": "0"}
    probe = "from contbatch import ops; print(ops.amx_bf16_matmuls())"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@settings(max_examples=30, deadline=None)
@given(out_features=st.integers(1, 150), in_features=st.integers(1, 40))
def test_panel_layout_round_trips(out_features, in_features):
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    packed = pack_panels(weight)
    panels = -(-out_features // PANEL_COLUMNS)
    assert packed.shape == (panels, -(-in_features // 2), PANEL_COLUMNS, 2)
    assert torch.equal(unpack_panels(packed, out_features, in_features), weight)
    padded = unpack_panels(packed, panels * PANEL_COLUMNS, packed.shape[1] * 2)
    assert (padded[out_features:] == 0).all() and (padded[:, in_features:] == 0).all(), "padding must be zero"


def test_bf16_linear_rejects_bad_arguments_by_name():
    x, out = torch.empty(3, 10, dtype=torch.bfloat16), torch.empty(3, 70, dtype=torch.bfloat16)
    packed = pack_panels(torch.empty(70, 10, dtype=torch.bfloat16))
    cases = [
        (lambda: native.bf16_linear(out, x.float(), packed, None), "input must be torch.bfloat16"),
        (lambda: native.bf16_linear(out, x, packed[:1].contiguous(), None), "packed_weight must be"),
        (lambda: native.bf16_linear(out, x, packed, torch.empty(69, dtype=torch.bfloat16)), "bias must be"),
        (lambda: native.bf16_linear(torch.empty(2, 70, dtype=torch.bfloat16), x, packed, None), "out has 2 rows"),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
