// The int8 section (int8_linear_kernel.h) for AVX2: the stored weights (q + 128) widened
// to int16 and multiplied by vpmaddwd, which adds pairs of int16 products into int32 lanes,
// 16 products an instruction, exactly (no vpmaddubsw saturation). A 256-bit register holds
// 4 columns x 4 inputs; its int32 lanes hold each column's two pair sums, added at the
// block's end, and the row's block offset (-128 x the block's input sum) starts one lane of
// each column.
// Included after simd_avx2.h inside an int8 TU's target region.
#pragma once

#include "simd_int8_ymm.h"

// The driver sign-extends the inputs to int16 once per call (a quad: 8 bytes). Widening them
// in the kernel instead, once per row tile and panel, took 13% of a 256-row call (Zen 5).
constexpr int kI8InputBytes = 2;
using I8Input = __m256i;
struct I8Acc {
  __m256i lanes[4];  // columns 4j .. 4j + 3, two int32 pair sums each
};
struct I8Weights {
  __m256i columns[4];  // columns 4j .. 4j + 3 x 4 inputs, int16
};

// 2 rows x 16 columns: 8 accumulator registers, the widened weights and the inputs in the
// 16 ymm registers (measured best of 1-4 rows, with the AVX2 tier forced on an Intel Xeon).
constexpr int kI8TileRows = 2;
constexpr int kI8TileVectors = 1;
// Calls of up to 16 rows run in tiles of 1-2 rows that span the panel, one 16-column vector
// of a block at a time (int8_linear_kernel.h, i8_group_vectors): the 2 x 16 tile read each
// 256-byte quad row in 4 strided passes. With the AVX2 tier forced on a Zen 4, SmolLM2's
// projections at 1 / 4 / 8 / 16 rows: 11.4 / 14.2 / 18.8 / 31.5 ms before, 7.0 / 8.7 / 15.0 /
// 29.5 after (weights from DRAM; not measured on a Zen 3 itself).
constexpr int kI8WholePanelRows = 2;
constexpr int kI8WholePanelRunRows = 16;
constexpr int kI8WholePanelGroup = 1;

// Not unrolled: GCC reassociates the unrolled vpmaddwd sums and spills the products (1.5x
// slower at 256 rows unrolled, Zen 5).
#define CONTBATCH_I8_QUAD_UNROLL 1
inline I8Input i8_input(const int8_t* x) {  // the row's quad, 4 int16 inputs, in every 64-bit lane
  int64_t quad;
  std::memcpy(&quad, x, sizeof quad);
  return _mm256_set1_epi64x(quad);
}
inline I8Acc i8_start(int32_t offset) {  // the offset in each column's first pair-sum lane
  const __m256i start = _mm256_set_epi32(0, offset, 0, offset, 0, offset, 0, offset);
  return {{start, start, start, start}};
}
inline I8Weights i8_load(const uint8_t* w) {
  I8Weights widened;
  for (int j = 0; j < 4; ++j) {
    widened.columns[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j)));
  }
  return widened;
}
// From a panel widened once per call (int8_linear_kernel.h) when a call has 32 rows or more:
// 13% faster at 256 rows, slower at 8 (measured as above).
#define CONTBATCH_I8_WIDENS 1
constexpr int64_t kI8WidenFromRows = 32;
inline I8Weights i8_load(const int16_t* w) {
  I8Weights loaded;
  for (int j = 0; j < 4; ++j) loaded.columns[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
  return loaded;
}
inline void i8_dot(I8Acc& acc, const I8Weights& w, I8Input x) {
  for (int j = 0; j < 4; ++j) acc.lanes[j] = _mm256_add_epi32(acc.lanes[j], _mm256_madd_epi16(w.columns[j], x));
}
// hadd of columns 0-3 and 4-7 gives [c0 c1 c4 c5 | c2 c3 c6 c7]; the 64-bit permute puts them in order.
inline __m256 column_sums8(__m256i first, __m256i second) {
  return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(first, second), 0xD8));
}
inline Vec16 i8_finish(const I8Acc& acc) {
  return {column_sums8(acc.lanes[0], acc.lanes[1]), column_sums8(acc.lanes[2], acc.lanes[3])};
}
