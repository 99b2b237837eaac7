"""Linear layers packed for oneDNN give F.linear's results (bf16 bit for bit)."""

import pytest
import torch
import torch.nn.functional as F

from contbatch.layers.linear import Linear, can_pack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_equals_f_linear(dtype, bias, rows):
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=bias).to(dtype)
    weight = layer.weight.detach().clone()
    bias_value = None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(rows, 96).to(dtype)
    expected = F.linear(x, weight, bias_value)
    if not can_pack(layer.weight):
        pytest.skip("this torch build has no oneDNN")
    assert layer.pack() and layer.packed_weight is not None
    assert not layer.pack(), "packing twice must be a no-op"
    with torch.inference_mode():
        out = layer(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_dtypes_onednn_cannot_pack_stay_plain():
    layer = Linear(8, 8).to(torch.float64)
    assert not layer.pack() and layer.packed_weight is None
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
