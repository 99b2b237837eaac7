// The int8 section (int8_linear_kernel.h) for AVX-VNNI: the VEX-encoded 256-bit vpdpbusd of
// Intel's AVX2 client CPUs (Alder Lake and later), which have no AVX-512. Like the AVX-512
// VNNI section, 4 unsigned bytes times 4 signed bytes are added into an int32 lane, 32
// products an instruction (twice vpmaddwd's 16, with no separate add): the stored weights
// (q + 128) unsigned, the inputs signed, each block's accumulator starting at the row's
// offset (simd_int8_dpbusd.h). The VEX encoding has no embedded broadcast: the quad is
// broadcast into a register. Never run here: no CPU of this project's machines has
// AVX-VNNI without AVX-512 (tests run it where the CPU has it).
// One lane is one column (the panel's [column][4] order), 8 columns a register.
// Included after simd_avx2.h inside an int8 TU's target region.
#pragma once

#include "simd_int8_dpbusd.h"

#include "simd_int8_ymm.h"

using I8Input = __m256i;
struct I8Acc {
  __m256i columns[2];  // columns 0-7 and 8-15, int32
};
struct I8Weights {
  __m256i columns[2];  // columns 0-7 and 8-15 x 4 stored weights (q + 128)
};

// 4 rows x 16 columns: 8 int32 accumulators, 2 weight registers and an input in the 16 ymm
// registers, the fp32 sums over blocks beside them (3, 4 and 6 rows measured with the AVX2 tier
// forced on an Emerald Rapids Xeon: 3 and 4 alike at 256 rows, 4 better at 4 rows).
constexpr int kI8TileRows = 4;
constexpr int kI8TileVectors = 1;
constexpr int kI8WholePanelRows = 0;  // no tile spans the panel (int8_linear_kernel.h)
constexpr int kI8WholePanelRunRows = 0;
constexpr int kI8WholePanelGroup = 1;
constexpr int kI8WholePanelRegisterRows = kI8WholePanelRows;  // sums in registers
constexpr bool kI8LoneTileWithoutPrefetch = false;  // no tile spans the panel

inline I8Input i8_input(const int8_t* x) { return _mm256_set1_epi32(int(i8_quad(x))); }
inline I8Acc i8_start(int32_t offset) {
  const __m256i start = _mm256_set1_epi32(offset);
  return {{start, start}};
}
inline I8Weights i8_load(const uint8_t* w) {
  return {{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32))}};
}
inline void i8_dot(I8Acc& acc, const I8Weights& w, I8Input x) {
  for (int h = 0; h < 2; ++h) acc.columns[h] = _mm256_dpbusd_avx_epi32(acc.columns[h], w.columns[h], x);
}
inline Vec16 i8_finish(const I8Acc& acc) {
  return {_mm256_cvtepi32_ps(acc.columns[0]), _mm256_cvtepi32_ps(acc.columns[1])};
}
