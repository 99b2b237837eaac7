// What the int8 sections with one int32 lane a column share: the vpdpbusd ones
// (simd_int8_vnni.h, simd_int8_avx_vnni.h) and AVX2's vpmaddubsw one (simd_int8_avx2.h, which
// sets its own unroll first). vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds
// the 4 products to an int32 lane: the unsigned side is the stored weights (q + o), the
// signed side the inputs, as quantized, and each block's accumulator starts at the row's
// offset (-o x the block's input sum), which takes the +o out (o: 128, or 64 for narrow
// weights; int8_kernel_api.h).
#pragma once

// A row's quad at x: 4 signed bytes.
inline uint32_t i8_quad(const int8_t* x) {
  uint32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return bits;
}
// The quad loop unrolled whole (a block's 8 or 16 quads): GCC otherwise kept every accumulator in
// two registers and copied it twice an iteration around the tied operand of vpdpbusd. On Zen 5
// (2 threads, SmolLM2's projections at 256 rows) the AVX-512 VNNI kernel ran 1.27x faster
// unrolled and the AVX-VNNI one 1.5x.
#ifndef CONTBATCH_I8_QUAD_UNROLL
#define CONTBATCH_I8_QUAD_UNROLL 16
#endif
