// Input staging shared by the vpdpbusd int8 sections (simd_int8_vnni.h, simd_int8_avx_vnni.h):
// vpdpbusd multiplies unsigned by signed bytes, so each input enters as q + 128 and the
// section starts each block's accumulator at -128 * (the column's sum of weights).
#pragma once

using StagedQuad = uint32_t;  // q + 128, 4 unsigned bytes

inline StagedQuad stage_quad(const int8_t* x) {
  uint32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return bits ^ 0x80808080u;  // flipping the sign bit of a two's complement byte adds 128
}
// Staging a quad is one XOR, cheaper in the vector after the broadcast (i8_input) than
// staging the tile's rows again for every panel: the kernel broadcasts from the rows.
constexpr bool kI8InputsFromRows = true;
// The quad loop unrolled whole (a block's 8 quads): GCC otherwise kept every accumulator in
// two registers and copied it twice an iteration around the tied operand of vpdpbusd. On Zen 5
// (2 threads, SmolLM2's projections at 256 rows) the AVX-512 VNNI kernel ran 1.27x faster
// unrolled and the AVX-VNNI one 1.5x.
#define CONTBATCH_I8_QUAD_UNROLL 8
