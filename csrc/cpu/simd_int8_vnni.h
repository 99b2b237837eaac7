// The int8 section (int8_linear_kernel.h) for AVX-512 with VNNI: vpdpbusd multiplies 4
// unsigned bytes (the stored weights, q + 128) by 4 signed bytes (an input quad) and adds
// them to an int32 lane, 64 products an instruction (twice vdpbf16ps's 32). The input quad
// rides in the instruction as an embedded broadcast from memory ({1to16}), so each
// vpdpbusd is the only vector µop its quad row of weights costs; each block's accumulator
// starts at the row's offset (simd_int8_dpbusd.h). With few rows the kernel waits on DRAM,
// and the vector µops queued behind those loads bound how far ahead it reads: with the
// inputs broadcast into a register first and each block started from per-column weight sums
// (the layout before), one thread read one-row weights at 15-16 GB/s on a Zen 4; a timing
// probe of this loop read at 24-25 (docs/performance.md, "Huge pages for the weights").
// Included after simd_avx512.h inside an int8 TU's target region.
#pragma once

#include "simd_int8_dpbusd.h"

using I8Input = const int32_t*;  // the quad, read by vpdpbusd itself
using I8Acc = __m512i;  // lane i: column i
using I8Weights = __m512i;  // lane i: the column's 4 weights

// 6 rows x 32 columns: 12 int32 and 12 fp32 accumulators, 2 weight vectors and an input in
// the 32 registers (measured best of 3-12 rows x 16-64 columns on an Emerald Rapids Xeon).
constexpr int kI8TileRows = 6;
constexpr int kI8TileVectors = 2;
// Calls of up to 10 rows run in tiles of 1-4 rows that span the 64-column panel (4 int32 and
// 4 fp32 accumulators a row; int8_linear_kernel.h, i8_tile_vectors). On Zen 4, SmolLM2's
// projections at 1-16 rows went from 0.81-1.14x the bf16 panels' speed to 1.30-1.38x
// (weights from DRAM). Once the 6 x 32 tiles prefetched the next panel too and split rows
// evenly (int8_row_tiles), they were the faster from 11 rows on: 13 and 16 rows 9.7-9.9 and
// 10.6 ms against 10.9-13.8 and 11.7-15.9 (two of three alternated rounds; with the weights
// in cache 5.1 against 6.5-6.7 ms at 12 rows), while at 8-10 rows the spanning tiles, which
// read each panel once in address order, kept level or ahead (Zen 4, 2026-11-27). Tiles of 3
// rows rather than 2 (3 vpdpbusd to each weight load, 24 accumulators and 4 weight vectors
// in the 32 registers) took one layer's projections 30 times over, weights in cache, from
// 2.46 to 1.86 ms at 3 rows, 3.39 to 2.96 at 6, 4.12 to 3.70 at 8 and 4.82 to 3.90 at 9
// (about 0.15 ms of each is the driver's cheaper staging, int8_linear.cpp); tiles of 4 were
// no faster than 3, and spanning tiles up to 16 rows no faster than the 6 x 32 ones from 11
// (Zen 4, 2026-11-27, eighth session). Since 2026-12-07 a tile of 4 rows spans the panel too,
// its 16 int32 accumulators in registers and its fp32 sums in L1 (i8_sums_in_memory): one pass
// over the panel where two 2-row tiles read it twice. Alternated against the build before
// (two rounds, weights in cache, SmolLM2's four projection shapes, Zen 4): 4 rows 0.77-0.97x
// the time, 7 rows (4 + 3) 0.80-1.0x, 10 rows (4 + 3 + 3) 0.85-0.98x, 8 rows (4 + 4 against
// 3 + 3 + 2) 0.81-1.05x, against 0.87-1.03x for 5 rows, whose tiles did not change; with
// tiles of 5 and 6 rows the same way, 5 and 6 rows took 1.02-1.09x.
constexpr int kI8WholePanelRows = 4;
constexpr int kI8WholePanelRunRows = 10;
constexpr int kI8WholePanelGroup = 4;
constexpr int kI8WholePanelRegisterRows = 3;  // 12 int32 and 12 fp32 accumulators at 3 rows
constexpr bool kI8LoneTileWithoutPrefetch = true;  // where the CPU reads faster so (int8_linear.cpp)

inline I8Input i8_input(const int8_t* x) { return reinterpret_cast<const int32_t*>(x); }
inline I8Acc i8_start(int32_t offset) { return _mm512_set1_epi32(offset); }
inline I8Weights i8_load(const uint8_t* w) { return _mm512_loadu_si512(w); }
// GCC does not fold a broadcast into vpdpbusd's memory operand from the intrinsics: it
// broadcasts into a register first, one more vector µop a quad. The asm works on a copy:
// with the caller's accumulator array as its operand, GCC kept the array on the stack and
// stored every accumulator after each vpdpbusd.
inline void i8_dot(I8Acc& acc, I8Weights w, I8Input x) {
  I8Acc sum = acc;
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[sum]" : [sum] "+v"(sum) : [w] "v"(w), [x] "m"(*x));
  acc = sum;
}
inline Vec16 i8_finish(I8Acc acc) { return _mm512_cvtepi32_ps(acc); }
inline Vec16 vload_f16(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline void i8_store_rounded(int8_t* q, Vec16 v) {  // |v| <= 127 by construction
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
