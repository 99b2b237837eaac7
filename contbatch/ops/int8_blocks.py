"""8-bit block quantization (llama.cpp's Q8_0 shape) and the int8 linear kernel's layout.

A row of a weight or an activation is cut into blocks of 32 or 64 inputs; each block stores
that many signed 8-bit values and one scale, and stands for ``q * scale``. 32 is Q8_0's
block (``Q8_0_BLOCK``): a GGUF file's Q8_0 tensors (int8 values, one fp16 scale a block)
are this format as they are, so they go into the kernel without a round trip through a
dense dtype. ``LLM(quantization="int8")`` quantizes in blocks of 64 where the int8 kernel
is the AVX-512 VNNI one (``contbatch.ops.int8_weight_block``): the kernel turns a block's
int32 sums into fp32 (three vector operations a 16-column accumulator) once per block, which
at 256 rows is a quarter of a 32-input block's work and an eighth of a 64-input one's
(docs/performance.md, "64-input blocks"). Each weight's activations are quantized in that
weight's blocks. Weights keep their scales
in fp16 as Q8_0 does; activations (quantized per token on every call) keep theirs in fp32.

The kernel's weight layout (``csrc/cpu/int8_linear_kernel.h``) is panels of 64 output
columns, like the bf16 kernel's (``panel_layout.py``), in quads of 4 inputs:
``values[panel, block, quad, column, :]`` holds ``q[64 * panel + column, B * block + 4 * quad : + 4]``
(B: the block's inputs):
one ``[quad]`` row (64 columns x 4 inputs, 256 bytes) is what AVX-512 VNNI's ``vpdpbusd``
multiplies against one broadcast quad of inputs. The values are stored as unsigned bytes,
q + 128: ``vpdpbusd`` multiplies unsigned bytes by signed ones, and with the weights the
unsigned side the activations stay signed and can be broadcast straight from memory into
the instruction, while the offset costs one correction per row and block, -128 times the
block's activation sum, computed once per call (instead of one per column, block and
call from a stored sum of each weight block). Beside the values, per panel, block and
column: the fp16 scale.

Narrow weights, quantized to |q| <= 64 (``quantize_weight(qmax=NARROW_QMAX)``), are stored
as q + 64 instead, in [0, 128], their offsets -64 times the sums: AVX2's ``vpmaddubsw``
multiplies such bytes by 8-bit activations as they are, without ``vpsignb``, and a pair of
products cannot saturate its int16 (csrc/cpu/simd_int8_avx2.h). ``LLM(quantization="int8")``
quantizes every linear layer but the LM head narrow where that kernel runs
(``contbatch.ops.int8_weight_qmax``). On a Zen 3 (docs/performance.md, "Zen 3, 2026-12-03
(twenty-fourth session)"), SmolLM2's projections at 256 rows took 0.83x the time with every one
narrow (a trial); narrow but the LM head, as shipped, perplexity is +0.77% against bf16 rather
than +0.66% with all 8 bits; the LM head narrow too cost +1.19%.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q8_0_BLOCK = 32  # a GGUF file's Q8_0 block, and the functions' default
WIDE_BLOCK = 64
BLOCK_SIZES = (Q8_0_BLOCK, WIDE_BLOCK)  # those the kernels serve
QUAD = 4
PANEL_COLUMNS = 64
QMAX = 127  # values lie in [-127, 127]: symmetric, so -q never overflows
WEIGHT_OFFSET = 128  # packed weights are stored as q + 128 (module docstring)
NARROW_QMAX = 64  # narrow weights: |q| <= 64, ...
NARROW_OFFSET = 64  # ... stored as q + 64, in [0, 128] (module docstring)


@dataclass(frozen=True)
class Int8Blocks:
    """A matrix [rows, in_features] in 8-bit blocks: ``values`` int8 [rows, padded_in]
    (``padded_in`` = in_features rounded up to a whole block, zero-filled) and ``scales``
    [rows, padded_in / block] (fp16 for weights, fp32 for activations)."""

    values: torch.Tensor
    scales: torch.Tensor
    in_features: int

    @property
    def block(self) -> int:
        """Inputs a block (one of BLOCK_SIZES)."""
        return self.values.shape[1] // self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, padded = self.values.shape
        blocks = self.values.view(rows, -1, self.block).float() * self.scales.float().unsqueeze(-1)
        return blocks.view(rows, padded)[:, : self.in_features].to(dtype)


def padded_inputs(in_features: int, block: int = Q8_0_BLOCK) -> int:
    return -(-in_features // block) * block


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, in_features] as fp32 [rows, blocks, block], zero-padded."""
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block}")
    rows, in_features = x.shape
    padded = F.pad(x.float(), (0, padded_inputs(in_features, block) - in_features))
    return padded.view(rows, -1, block)


def quantize_weight(weight: torch.Tensor, block: int = Q8_0_BLOCK, qmax: int = QMAX) -> Int8Blocks:
    """Q8_0's rule in blocks of ``block`` inputs for ``weight`` [out_features, in_features]:
    per block, scale = max|w| / qmax rounded to fp16, values = round-half-even(w / scale).
    qmax: 127 (Q8_0's), or 64 for narrow weights (module docstring)."""
    if qmax not in (QMAX, NARROW_QMAX):
        raise ValueError(f"qmax must be {QMAX} or {NARROW_QMAX} (narrow weights), got {qmax}")
    blocks = _blocks(weight.detach(), block)
    scales = (blocks.abs().amax(dim=-1) / qmax).to(torch.float16)
    inverse = torch.where(scales > 0, torch.ones_like(scales, dtype=torch.float32) / scales.float(), torch.zeros(()))
    return Int8Blocks(_rounded(blocks, inverse, qmax), scales, weight.shape[1])


def quantize_activations(x: torch.Tensor, block: int = Q8_0_BLOCK) -> Int8Blocks:
    """Per-token quantization of ``x`` [rows, in_features] in blocks of ``block`` inputs, as the
    kernel does it (``int8_quantize_rows``): scale = max|x| / 127 in fp32, values =
    round-half-even(x * (127 / max|x|))."""
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(dim=-1)
    # A tensor over a tensor: torch computes a scalar over a tensor as a reciprocal times the
    # scalar, one rounding more than the kernel's division.
    inverse = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros((), dtype=torch.float32))
    return Int8Blocks(_rounded(blocks, inverse), amax / torch.full_like(amax, QMAX), x.shape[1])


def _rounded(blocks: torch.Tensor, inverse: torch.Tensor, qmax: int = QMAX) -> torch.Tensor:
    """int8 [rows, padded_in]: each block [rows, blocks, block] times its inverse scale, rounded
    half to even (as the kernel's conversion) and held to [-qmax, qmax]."""
    values = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    return values.view(blocks.shape[0], -1)


@dataclass(frozen=True)
class PackedInt8:
    """A quantized weight in the int8 kernel's layout (module docstring)."""

    values: torch.Tensor  # uint8 [panels, blocks, block / 4, 64, 4]: q + offset
    scales: torch.Tensor  # fp16 [panels, blocks, 64]
    out_features: int
    in_features: int
    offset: int = WEIGHT_OFFSET  # or NARROW_OFFSET, for narrow weights

    @property
    def block(self) -> int:
        """Inputs a block (one of BLOCK_SIZES)."""
        return packed_block(self.values)


def packed_block(values: torch.Tensor) -> int:
    """Inputs a block of packed weight values [panels, blocks, quads, 64, 4]."""
    return values.shape[2] * QUAD


def pack_int8(weight: Int8Blocks, narrow: bool = False) -> PackedInt8:
    """``weight`` in the kernel's layout, as q + 128, or with ``narrow`` as narrow weights, q +
    64 (every |q| at most 64: ``quantize_weight(qmax=NARROW_QMAX)``)."""
    out_features, padded = weight.values.shape
    panels, blocks = -(-out_features // PANEL_COLUMNS), weight.scales.shape[1]
    extra_rows = panels * PANEL_COLUMNS - out_features
    values = F.pad(weight.values, (0, 0, 0, extra_rows))
    scales = F.pad(weight.scales.to(torch.float16), (0, 0, 0, extra_rows))
    wide = values.to(torch.int16)  # abs() of an int8 -128 is -128
    if narrow and wide.numel() > 0 and int(wide.abs().max()) > NARROW_QMAX:
        raise ValueError(f"pack_int8: narrow weights must lie in [-{NARROW_QMAX}, {NARROW_QMAX}], "
                         f"got |q| up to {int(wide.abs().max())}")
    offset = NARROW_OFFSET if narrow else WEIGHT_OFFSET
    stored = (wide + offset).to(torch.uint8)
    by_block = stored.view(panels, PANEL_COLUMNS, blocks, weight.block // QUAD, QUAD)
    return PackedInt8(
        values=by_block.permute(0, 2, 3, 1, 4).contiguous(),
        scales=scales.view(panels, PANEL_COLUMNS, blocks).transpose(1, 2).contiguous(),
        out_features=out_features,
        in_features=weight.in_features,
        offset=offset,
    )


def unpack_int8(packed: PackedInt8) -> Int8Blocks:
    """Inverse of :func:`pack_int8`."""
    panels, blocks = packed.values.shape[:2]
    stored = packed.values.permute(0, 3, 1, 2, 4).reshape(panels * PANEL_COLUMNS, blocks * packed.block)
    values = (stored.to(torch.int16) - packed.offset).to(torch.int8)
    scales = packed.scales.transpose(1, 2).reshape(panels * PANEL_COLUMNS, blocks)
    return Int8Blocks(values[: packed.out_features], scales[: packed.out_features], packed.in_features)


def int8_linear_reference(x: Int8Blocks, weight: Int8Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T from the 8-bit blocks (the same size in both), in float64: each block's
    integer dot product is exact, times its activation and weight scales, summed over blocks
    (+ bias)."""
    if x.block != weight.block:
        raise ValueError(f"activations in blocks of {x.block}, weight in blocks of {weight.block}")
    xb = x.values.view(x.values.shape[0], -1, x.block).double()
    wb = weight.values.view(weight.values.shape[0], -1, weight.block).double()
    dots = torch.einsum("mbk,nbk->mnb", xb, wb)
    result = (dots * x.scales.double().unsqueeze(1) * weight.scales.double().unsqueeze(0)).sum(-1)
    if bias is not None:
        result += bias.double()
    return result
