// Input staging shared by the vpdpbusd int8 sections (simd_int8_vnni.h, simd_int8_avx_vnni.h):
// vpdpbusd multiplies unsigned by signed bytes, so each input enters as q + 128 and the
// section starts each block's accumulator at -128 * (the column's sum of weights).
#pragma once

// The driver (int8_linear.cpp) XORs every input byte with this before the panel kernel runs,
// once per call: flipping the sign bit of a two's complement byte adds 128. Done in the
// kernel, one vpxord per broadcast quad, it cost as much as the broadcasts themselves: on
// Zen 5, SmolLM2's projections at 64 rows took 18.7-21 ms with it and 14.0-14.8 without.
constexpr uint8_t kI8InputXor = 0x80;

constexpr int kI8InputBytes = 1;  // each input one byte, q + 128

// A row's quad at x: 4 unsigned bytes, q + 128 (as the driver staged them).
inline uint32_t i8_quad(const int8_t* x) {
  uint32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return bits;
}
// The quad loop unrolled whole (a block's 8 quads): GCC otherwise kept every accumulator in
// two registers and copied it twice an iteration around the tied operand of vpdpbusd. On Zen 5
// (2 threads, SmolLM2's projections at 256 rows) the AVX-512 VNNI kernel ran 1.27x faster
// unrolled and the AVX-VNNI one 1.5x.
#define CONTBATCH_I8_QUAD_UNROLL 8
