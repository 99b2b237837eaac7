"""Linear layers with weights laid out once, after loading, for a fast CPU kernel.

PyTorch's CPU ``F.linear`` takes a plain row-major weight and pays for that layout on
every call. Two layouts replace it:

- ``panels`` (bf16, wherever the extension is built): contbatch's own ``bf16_linear``
  kernel (csrc/cpu/linear_kernel.h, layout in ``contbatch/ops/panel_layout.py``), on every
  ISA tier: vdpbf16ps on AVX512_BF16 CPUs, bf16 widened to fp32 FMAs on AVX2 and AVX-512
  without it. On AVX512_BF16 (Zen 5, 2026-11-26) it ran 1.3-1.4x faster than oneDNN from
  one to 16 rows over SmolLM2's 121 projections (6.2 against 7.9 ms a step at one row, 43
  GB/s of weights), 1.2x at 32-64 rows and level at 256-720 (benchmarks/linear.py; tables
  per CPU in docs/performance.md). On AVX2 CPUs oneDNN has no bf16 path at all. Sums are
  fp32 in a different order from F.linear's, so a result can differ by one bf16 rounding step.
- ``int8`` (``LLM(quantization="int8")``, or Q8_0 tensors of a GGUF file): 8-bit weights in
  blocks of 64 inputs (a Q8_0 tensor's: 32) with an fp16 scale each, activations quantized
  per token in the weight's blocks on every call, int32 block sums
  (contbatch/ops/int8_blocks.py, csrc/cpu/int8_linear_kernel.h).
- ``onednn`` (fp32; bf16 only without the extension, on CPUs where oneDNN does bf16):
  oneDNN's blocked format, called directly; 1.3-2.4x faster than ``F.linear`` for the
  few-token matmuls of decode and no slower at 256 tokens, with ``F.linear``'s results.

On CPUs with AMX (``ops.amx_bf16_matmuls``: Sapphire Rapids and later Xeons) the same panels
feed AMX tiles: a panel's pair rows are the B operand ``tdpbf16ps`` reads, so ``bf16_linear``
runs calls of 5 rows or more in AMX tiles (csrc/cpu/linear_amx_kernel.h) and fewer on the
vector kernel, from one copy of the weight.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from contbatch import ops
from contbatch.lora.layers import LinearLoRA
from contbatch.ops.int8_blocks import NARROW_QMAX, QMAX, Q8_0_BLOCK, Int8Blocks, PackedInt8, pack_int8, quantize_weight
from contbatch.ops.panel_layout import pack_panels

if TYPE_CHECKING:
    from contbatch.config import Quantization

_ONEDNN_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out_features, in_features] in a kernel's layout; read by ``packed_linear``."""

    data: torch.Tensor | PackedInt8
    layout: str  # "panels", "onednn" or "int8"
    out_features: int


def onednn_can_pack(weight: torch.Tensor) -> bool:
    if weight.dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on other CPUs it raises.
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panel_packed(weight: torch.Tensor) -> PackedWeight:
    """``weight`` (bf16, CPU) in the panel layout of contbatch's ``bf16_linear``."""
    return PackedWeight(pack_panels(weight), "panels", weight.shape[0])


def onednn_packed(weight: torch.Tensor) -> PackedWeight:
    """``weight`` (CPU) in oneDNN's blocked layout."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    return PackedWeight(packed, "onednn", weight.shape[0])


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The fastest layout this CPU and build have for ``weight``; None: keep it plain."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and ops.bf16_linear_available():
        return panel_packed(weight)
    if onednn_can_pack(weight):
        return onednn_packed(weight)
    return None


def int8_packed(weight: Int8Blocks, narrow: bool = False) -> PackedWeight:
    """A weight in 8-bit blocks, in the int8 kernel's layout (``narrow``: pack_int8's)."""
    return PackedWeight(pack_int8(weight, narrow), "int8", weight.values.shape[0])


def int8_quantized(weight: torch.Tensor, block: int, qmax: int = QMAX) -> PackedWeight:
    """``weight`` quantized by Q8_0's rule in blocks of ``block`` inputs to |q| <= qmax, in the
    int8 kernel's layout: narrow weights where qmax is NARROW_QMAX (ops/int8_blocks.py)."""
    return int8_packed(quantize_weight(weight, block, qmax), narrow=qmax == NARROW_QMAX)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN for ``weight`` in its blocked layout (``onednn_packed``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.layout == "onednn":
        return onednn_linear(x, packed.data, bias)
    # The model's activations are 2-D already: skipping reshape and view there saves ~2 us a
    # call, 121 calls a decode step.
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=x.dtype, device=x.device)
    if packed.layout == "int8":
        weight = packed.data
        ops.int8_quantize_linear(out, rows, weight.values, weight.scales, bias, weight.offset)
    else:
        ops.bf16_linear(out, rows, packed.data, bias)
    return out if flat else out.view(*x.shape[:-1], packed.out_features)


class Linear(nn.Linear):
    """``nn.Linear`` that can swap its weight for a packed one after loading, and add LoRA
    adapters' updates to the rows of the requests that run with them (contbatch/lora)."""

    packed_weight: PackedWeight | None = None
    lora: "LinearLoRA | None" = None

    def pack(self) -> bool:
        """Re-lay the weight out (and free the plain copy); False where no layout applies."""
        if self.packed_weight is not None:
            return False
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self._replace_weight(packed)
        return True

    def quantize_int8(self, blocks: Int8Blocks | None = None, block: int = Q8_0_BLOCK, qmax: int = QMAX) -> None:
        """Runs on 8-bit weights from now on: ``blocks`` as given (a GGUF file's Q8_0
        tensor), or this layer's weight quantized by Q8_0's rule in blocks of ``block``
        inputs to |q| <= qmax (ops/int8_blocks.py)."""
        if self.packed_weight is not None:
            raise RuntimeError("quantize_int8: the weight is packed already")
        packed = int8_quantized(self.weight, block, qmax) if blocks is None else int8_packed(blocks)
        shape = (packed.out_features, packed.data.in_features)
        expected = (self.out_features, self.in_features)
        if shape != expected:
            raise ValueError(f"int8 weight is [{shape[0]}, {shape[1]}], layer needs {list(expected)}")
        self._replace_weight(packed)

    def _replace_weight(self, packed: PackedWeight) -> None:
        self.packed_weight = packed
        # The plain layout is never read again; keep only its dtype so repr() still works.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = packed_linear(x, self.packed_weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(out, x)
        return out


def quantize_linears(model: nn.Module, quantization: "Quantization", head: nn.Module | None) -> int:
    """Quantize every ``Linear`` of a loaded model to int8 as ``quantization`` says (its
    block, its qmax but the LM head ``head``'s, Q8_0's 127; the head only if it says so)
    except those packed already (a GGUF file's Q8_0 layers); returns how many were quantized."""
    skipped = () if quantization.lm_head else (head,)
    chosen = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is None and m not in skipped]
    for module in chosen:
        module.quantize_int8(block=quantization.block, qmax=QMAX if module is head else quantization.qmax)
    return len(chosen)


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of a loaded model; returns how many were packed."""
    return sum(module.pack() for module in model.modules() if isinstance(module, Linear))
