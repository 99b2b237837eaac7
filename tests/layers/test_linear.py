"""Packed Linear layers give F.linear's results: oneDNN's layout bit for bit, the bf16
panel layout (every ISA tier, when the extension is built) within one bf16 rounding step."""

import pytest
import torch
import torch.nn.functional as F

from contbatch import ops
from contbatch.layers import linear
from contbatch.layers.linear import Linear


def _layer_and_expected(dtype, bias, rows):
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=bias).to(dtype).requires_grad_(False)
    bias_value = None if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, 96).to(dtype)
    return layer, x, F.linear(x, layer.weight.clone(), bias_value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_packed_linear_equals_f_linear(dtype, bias, rows, monkeypatch):
    monkeypatch.setattr(linear.ops, "bf16_linear_available", lambda: False)
    if not linear.onednn_can_pack(torch.empty(1, dtype=dtype)):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU and torch build (bf16 needs AVX-512 or AVX-NE-CONVERT)")
    layer, x, expected = _layer_and_expected(dtype, bias, rows)
    assert layer.pack() and layer.packed_weight.layout == "onednn"
    assert not layer.pack(), "packing twice must be a no-op"
    with torch.inference_mode():
        out = layer(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_panel_packed_linear_matches_f_linear(bias, rows):
    if not ops.bf16_linear_available():
        pytest.skip("the bf16 panel kernel needs the built extension")
    layer, x, expected = _layer_and_expected(torch.bfloat16, bias, rows)
    assert layer.pack() and layer.packed_weight.layout == "panels"
    with torch.inference_mode():
        out = layer(x.view(rows, 1, 96)).view(rows, 80)  # leading dims are flattened and restored
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-3)


def test_dtypes_no_kernel_packs_stay_plain():
    layer = Linear(8, 8).to(torch.float64)
    assert not layer.pack() and layer.packed_weight is None
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
