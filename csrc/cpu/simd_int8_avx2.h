// The int8 section (int8_linear_kernel.h) for AVX2: vpmaddubsw multiplies 32 unsigned bytes
// by 32 signed ones and adds adjacent pairs into int16 lanes, vpmaddwd by ones adds those
// pairs into one int32 lane per column (the panel's [column][4] order, 8 columns a
// register, as AVX-VNNI's vpdpbusd does in one instruction). vpmaddubsw saturates, so a pair
// must stay within 32,767, and there are two ways to keep it there:
// - Weights of the full range (stored q + 128, |q| <= 128: a GGUF file's Q8_0 tensors, and
//   the LM head contbatch quantizes): the unsigned side is |q| and the signed side the input
//   with q's sign (vpsignb), both at most 127 but |q| = 128 for a GGUF file's -128, so a pair
//   sums to at most 2 x 128 x 127 = 32,512: exact. The products are of q itself, so a
//   block's accumulator starts at zero and the driver's offsets go unused.
// - Narrow weights (stored q + 64, |q| <= 64: what LLM(quantization="int8") quantizes the
//   other linears to where this kernel runs, ops.int8_weight_qmax): the stored byte is the
//   unsigned side as it is, at most 128, so again a pair is at most 32,512, and the block
//   starts at the driver's offset (-64 x its input sum) as in the vpdpbusd sections. The
//   vpxor, vpabsb and vpsignb go: SmolLM2's 121 projections at 256 rows took 0.83x the time
//   (290 against 351 ms, 2 threads, Zen 3, 2026-12-03; benchmarks/linear.py), 8 rows 0.85x,
//   one row 0.87x (all narrow, a trial). Their quality: docs/performance.md, "Zen 3, 2026-12-03
//   (twenty-fourth session)".
//
// Why not vpmaddwd on weights widened to int16 (this tier's kernel until 2026-12-02): a Zen 3
// issues one vpmaddwd a cycle (16 products), the same rate as its two 8-lane FMAs, and the
// kernel ran at that limit (170 GOP/s from 256 rows against the bf16 panels' 143 GFLOP/s,
// benchmarks/linear.py). vpmaddubsw and vpmaddwd issue on different pipes, so vpsignb,
// vpmaddubsw, vpmaddwd and vpaddd make 32 products in about a cycle: 70 against 44 G
// products a second on one Zen 3 core in a loop of independent sums (a throwaway
// microbenchmark, 2026-12-02); without the vpsignb (narrow weights), 96.
// Included after simd_avx2.h inside an int8 TU's target region.
#pragma once

#define CONTBATCH_I8_QUAD_UNROLL 1
#include "simd_int8_dpbusd.h"

#include "simd_int8_ymm.h"

using I8Input = __m256i;
struct I8Acc {
  __m256i columns[2];  // columns 0-7 and 8-15, int32
};
struct I8Weights {
  __m256i signs[2];       // columns 0-7 and 8-15 x 4 weights q, whose signs the inputs take
  __m256i magnitudes[2];  // |q| of the same, unsigned
};

// Calls of more than 10 rows: tiles of 3 rows x 16 columns (a shorter last one), which keep
// the three rows' block sums and all but one of their fp32 sums in registers (GCC 12 parks one
// on the stack across each block's quad loop) and load each quad row of weights once for
// three rows. Against 2-row tiles spanning the panel (this tier's tiles for every
// call until 2026-12-03): SmolLM2's 121 projections (narrow weights but the LM head) took
// 0.80-0.92x the time at 12 rows, 0.87-0.89x at 32, 0.80-0.87x at 128 and 0.81-0.84x at 256,
// but for one round at 0.57x in each of the last two (Zen 3, 2 threads, the two alternated in
// one process, four rounds), and chat256's int8 run was 1.11-1.12x as fast
// (docs/performance.md, "Zen 3, 2026-12-03 (twenty-seventh session)"). Earlier, with the sign trick for every weight, 3 rows had lost to 2 (0.85x
// against 0.79x of the bf16 panels' time at 256 rows); reading a copy of the panel with the
// vpxor and vpabsb done once a call (as the vpmaddwd kernel read one widened to int16) 0.78x
// with 2 or 3 rows: not worth its code. The quad loop unrolled whole, as the vpdpbusd
// sections have it, took 1.16x.
constexpr int kI8TileRows = 3;
constexpr int kI8TileVectors = 1;
// Calls of up to 10 rows, bound by reading the weights, run in tiles of 1-2 rows that span the
// panel, one 16-column vector of a block at a time (int8_linear_kernel.h, i8_group_vectors):
// a 16-column tile reads each 256-byte quad row in 4 strided passes. With the AVX2 tier
// forced on a Zen 4, SmolLM2's projections at 1 / 4 / 8 / 16 rows: 11.4 / 14.2 / 18.8 / 31.5
// ms before, 7.0 / 8.7 / 15.0 / 29.5 after (weights from DRAM, with the vpmaddwd kernel of
// then). The 3-row tiles took over from 11 rows on (Zen 3, 2026-12-03, the same rounds as
// above): at 3 rows they took 1.1-1.35x the spanning tiles' time, at 6-10 rows 0.93-1.25x
// (no clear side), at 12-16 rows 0.80-0.95x.
constexpr int kI8WholePanelRows = 2;
constexpr int kI8WholePanelRunRows = 10;
constexpr int kI8WholePanelGroup = 1;
constexpr int kI8WholePanelRegisterRows = kI8WholePanelRows;  // sums in registers
constexpr bool kI8LoneTileWithoutPrefetch = false;  // not measured without them (Zen 3)

inline I8Input i8_input(const int8_t* x) { return _mm256_set1_epi32(int(i8_quad(x))); }
inline I8Acc i8_start(int32_t /*offset: the products are of q, not q + 128*/) {
  return {{_mm256_setzero_si256(), _mm256_setzero_si256()}};
}
inline I8Weights i8_load(const uint8_t* w) {
  I8Weights loaded;
  for (int h = 0; h < 2; ++h) {
    const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
    loaded.signs[h] = _mm256_xor_si256(stored, _mm256_set1_epi8(char(0x80)));  // q + 128 -> q
    loaded.magnitudes[h] = _mm256_abs_epi8(loaded.signs[h]);                   // -128 -> 128, unsigned
  }
  return loaded;
}
inline void i8_dot(I8Acc& acc, const I8Weights& w, I8Input x) {
  for (int h = 0; h < 2; ++h) {
    const __m256i pairs = _mm256_maddubs_epi16(w.magnitudes[h], _mm256_sign_epi8(x, w.signs[h]));
    acc.columns[h] = _mm256_add_epi32(acc.columns[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}
// Narrow weights (the header comment): the stored bytes multiply the inputs as they are.
struct I8NarrowWeights {
  __m256i stored[2];  // columns 0-7 and 8-15 x 4 weights q + 64, in [0, 128]
};
inline void i8_dot(I8Acc& acc, const I8NarrowWeights& w, I8Input x) {
  for (int h = 0; h < 2; ++h) {
    const __m256i pairs = _mm256_maddubs_epi16(w.stored[h], x);
    acc.columns[h] = _mm256_add_epi32(acc.columns[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}
struct I8NarrowQuads {  // int8_linear_kernel.h's Quads for them
  using Weights = I8NarrowWeights;
  static I8Acc start(int32_t offset) { return {{_mm256_set1_epi32(offset), _mm256_set1_epi32(offset)}}; }
  static Weights load(const uint8_t* w) {
    return {{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32))}};
  }
};
#define CONTBATCH_I8_NARROW_QUADS I8NarrowQuads

inline Vec16 i8_finish(const I8Acc& acc) {
  return {_mm256_cvtepi32_ps(acc.columns[0]), _mm256_cvtepi32_ps(acc.columns[1])};
}
