// The int8 section (int8_linear_kernel.h) for AVX-512 with VNNI: vpdpbusd multiplies 4
// unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane, 64 products an
// instruction (twice vdpbf16ps's 32). Inputs enter as unsigned bytes q + 128; each block's
// accumulator starts at -128 * (the column's sum of weights) to cancel the offset exactly.
// Included after simd_avx512.h inside an int8 TU's target region.
#pragma once

#include "simd_int8_offset.h"

using I8Input = __m512i;
using I8Acc = __m512i;  // lane i: column i
using I8Weights = __m512i;  // lane i: the column's 4 weights

// 6 rows x 32 columns: 12 int32 and 12 fp32 accumulators, 2 weight vectors and an input in
// the 32 registers (measured best of 3-12 rows x 16-64 columns on an Emerald Rapids Xeon).
constexpr int kI8TileRows = 6;
constexpr int kI8TileVectors = 2;
// Calls of up to 16 rows run in tiles of 1-2 rows that span the 64-column panel (4 int32 and
// 4 fp32 accumulators a row; int8_linear_kernel.h, i8_tile_vectors). On Zen 4, SmolLM2's
// projections at 1-16 rows went from 0.81-1.14x the bf16 panels' speed to 1.30-1.38x
// (weights from DRAM); at 16 rows 10.6 ms against 12.4 in the 6 x 32 tiles, more rows not
// tried with them.
constexpr int kI8WholePanelRows = 2;
constexpr int kI8WholePanelRunRows = 16;
constexpr int kI8WholePanelGroup = 4;  // all 4: 8 int32 and 8 fp32 accumulators at 2 rows

inline I8Input i8_input(const int8_t* x) { return _mm512_set1_epi32(int(i8_quad(x))); }
inline I8Acc i8_start(const int16_t* sums) {
  const __m512i sum = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)));
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
}
inline I8Weights i8_load(const int8_t* w) { return _mm512_loadu_si512(w); }
inline void i8_dot(I8Acc& acc, I8Weights w, I8Input x) { acc = _mm512_dpbusd_epi32(acc, x, w); }
inline Vec16 i8_finish(I8Acc acc) { return _mm512_cvtepi32_ps(acc); }
inline Vec16 vload_f16(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline void i8_store_rounded(int8_t* q, Vec16 v) {  // |v| <= 127 by construction
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
