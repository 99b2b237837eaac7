// 16-lane fp32 vector operations on AVX-512, for two tiers: with CONTBATCH_AVX512_BF16
// defined (kernels_avx512_bf16.cpp) the bf16 dot products use vdpbf16ps; without it
// (kernels_avx512.cpp, Skylake-SP to Ice Lake) they are widened to fp32
// (simd_bf16_emulated.h). Included inside the tier's `#pragma GCC target` region and an
// anonymous namespace; simd_generic.h defines the same functions portably.
#pragma once

using Vec16 = __m512;
using Mask16 = __mmask16;

inline Vec16 vset1(float x) { return _mm512_set1_ps(x); }
inline Vec16 vzero() { return _mm512_setzero_ps(); }
inline Vec16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec16 vload(const uint16_t* bf16) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec16 vload(const int8_t* p) {  // 16 signed bytes, exactly
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, Vec16 v) { _mm512_storeu_ps(p, v); }
#ifdef CONTBATCH_AVX512_BF16
inline void vstore(uint16_t* bf16, Vec16 v) {  // round to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
inline void vstore(uint16_t* bf16, Vec16 v) {  // round to nearest even, NaN stays NaN
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16), _mm512_cvtepi32_epi16(rounded));
}
#endif
inline Vec16 vadd(Vec16 a, Vec16 b) { return _mm512_add_ps(a, b); }
inline Vec16 vsub(Vec16 a, Vec16 b) { return _mm512_sub_ps(a, b); }
inline Vec16 vmul(Vec16 a, Vec16 b) { return _mm512_mul_ps(a, b); }
inline Vec16 vdiv(Vec16 a, Vec16 b) { return _mm512_div_ps(a, b); }  // IEEE-exact, as scalar division
inline Vec16 vfma(Vec16 a, Vec16 b, Vec16 c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec16 vmask_fill(Mask16 keep, Vec16 v, float fill) { return _mm512_mask_blend_ps(keep, vset1(fill), v); }
inline Vec16 vmaskz(Mask16 keep, Vec16 v) { return _mm512_maskz_mov_ps(keep, v); }
inline float vreduce_max(Vec16 v) { return _mm512_reduce_max_ps(v); }
inline float vreduce_add(Vec16 v) { return _mm512_reduce_add_ps(v); }

inline Mask16 vgreater(Vec16 a, float b) { return _mm512_cmp_ps_mask(a, vset1(b), _CMP_GT_OQ); }
inline Mask16 vequal(Vec16 a, float b) { return _mm512_cmp_ps_mask(a, vset1(b), _CMP_EQ_OQ); }
inline Mask16 visnan(Vec16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Vec16 vmax(Vec16 a, Vec16 b) { return _mm512_max_ps(a, b); }  // b where either is NaN

#include "simd_exp2.h"

// 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2 (simd_exp2.h); scalef gives 0 for very
// negative x and inf past 2^127.
inline Vec16 vexp2(Vec16 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-150.0f)), vset1(128.0f));
  const Vec16 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction(vsub(x, n)), n);
}

// Lane t of the result is the sum of the lanes of v[t]: a transposing tree of adds.
inline Vec16 vsum_transpose(Vec16 v[16]) {
  Vec16 pairs[8];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = vadd(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  Vec16 quads[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane k: the lane-k sums of 4 vectors
    __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = vadd(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  Vec16 halves[2];
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: [x01, x23, y01, y23]
    halves[i] = vadd(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                     _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return vadd(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88), _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
// Whether an item over widened rows (a bf16 or int8 cache) loads its blocks ahead
// (attention_kernel.h, BlockLoader): yes, as measured on Zen 5 (simd_avx2.h says why AVX2
// does not).
constexpr bool kLoadAheadOfWidenedRows = true;

// Lane t: dot(q, k_rows[t]) over 16 * NC elements, for 16 key rows; bf16 widened to fp32
// (the AVX512_BF16 tier overloads this for bf16 below).
template <int NC, class T>
inline Vec16 qk_tile(const T* q, const T* const* k_rows) {
  Vec16 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = vzero();
  for (int c = 0; c < NC; ++c) {
    Vec16 qc = vload(q + 16 * c);
    for (int t = 0; t < 16; ++t) acc[t] = vfma(qc, vload(k_rows[t] + 16 * c), acc[t]);
  }
  return vsum_transpose(acc);
}

// 6 rows x 64 columns per linear tile (linear_kernel.h): 24 accumulators, 4 weight vectors
// (bf16 pairs, or widened on the tier without AVX512_BF16) and a broadcast input fit the 32
// vector registers, each weight load feeding 6 rows.
constexpr int kLinearTileRows = 6;
constexpr int kLinearTileVectors = 4;

#ifdef CONTBATCH_AVX512_BF16

// bf16 pair dot products for the linear kernel: lane i of a loaded pair row holds the pair
// (w[2i], w[2i + 1]); vdpbf16ps adds w[2i] * x.even + w[2i + 1] * x.odd to lane i.
using StagedPair = uint32_t;  // the pair's bits, broadcast as they are
inline StagedPair stage_pair(uint32_t bits) { return bits; }
// Staging changes nothing here, so the linear kernel broadcasts pairs from the input rows.
constexpr bool kPairsBroadcastAsStored = true;

// acc[m][v] += the pair row w's columns 16v.. times row m's pair x(m), by vdpbf16ps.
template <int MR, int NV, class PairOfRow>
inline void accumulate_pair_row(Vec16 (&acc)[MR][NV], const uint16_t* w, const PairOfRow& x) {
  __m512bh weights[NV];
  for (int v = 0; v < NV; ++v) weights[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * kLanes * v));
  for (int m = 0; m < MR; ++m) {
    const __m512bh input = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(x(m))));
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], weights[v], input);
  }
}

// Query rows for qk_tile and accumulator rows for accumulate_pv_pairs: fp32 as they are,
// bf16 zero-padded to a multiple of 32 elements (whole bf16 pair chunks).
template <class T, int NC>
constexpr int query_row_len() {
  return sizeof(T) == 2 ? (NC + 1) / 2 * 32 : NC * 16;
}
template <class T, int NC>
constexpr int acc_row_len() {
  return query_row_len<T, NC>();
}

// bf16 pairs multiplied exactly and accumulated in fp32 by vdpbf16ps.
template <int NC>
inline Vec16 qk_tile(const uint16_t* q, const uint16_t* const* k_rows) {
  constexpr int kFull = NC / 2;  // whole 32-element chunks; an odd NC leaves a 16-element tail
  Vec16 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = vzero();
  for (int c = 0; c < kFull; ++c) {
    __m512bh qc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * c));
    for (int t = 0; t < 16; ++t) {
      __m512bh kc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k_rows[t] + 32 * c));
      acc[t] = _mm512_dpbf16_ps(acc[t], qc, kc);
    }
  }
  if constexpr (NC % 2 == 1) {
    __m512bh qc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * kFull));
    for (int t = 0; t < 16; ++t) {
      __m512bh kc = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(0xFFFF, k_rows[t] + 32 * kFull));
      acc[t] = _mm512_dpbf16_ps(acc[t], qc, kc);
    }
  }
  return vsum_transpose(acc);
}

// bf16 p * V by vdpbf16ps, two keys per instruction. ------------------------------------
#define CONTBATCH_BF16_PAIR_PV 1

// Rounds p to bf16 into `out` and returns the rounded values as fp32.
inline Vec16 round_to_bf16(Vec16 p, uint16_t* out) {
  const __m256i bf16 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// 32 bf16 of a V row from element 32 * j; the last chunk of an odd NC holds 16, zero-padded.
template <int NC>
inline __m512i load_v_chunk(const uint16_t* row, int j) {
  if (NC % 2 == 1 && j == NC / 2) return _mm512_maskz_loadu_epi16(0xFFFF, row + 32 * j);
  return _mm512_loadu_si512(row + 32 * j);
}

// acc[r] = alpha[r] * acc[r] + sum_t prob[r][t] * V[t] for RB rows, t < n, with p in bf16
// (products exact, sums in fp32). V rows t and t + 1 are interleaved by unpack{lo,hi}_epi16,
// so lane k of accumulator 2j (2j + 1) holds, of the 32 dims of chunk j, dim
// 8 * (k / 4) + k % 4 (that + 4); unpermute_pairs restores the natural order.
// pair_of(r, t): (p[t], p[t + 1]) of row r as two bf16 in an int32, p[n] 0.
template <int NC, int RB, class PairOf>
inline void accumulate_pv_pairs(float* acc, int acc_len, const float* alpha, const PairOf& pair_of,
                                const uint16_t* const* v_rows, int n) {
  constexpr int kPairs = (NC + 1) / 2;
  Vec16 a[RB][2 * kPairs];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 2 * kPairs; ++c) a[r][c] = vmul(vload(acc + r * acc_len + 16 * c), vset1(alpha[r]));
  }
  for (int t = 0; t < n; t += 2) {
    __m512bh v[2 * kPairs];
    for (int j = 0; j < kPairs; ++j) {
      const __m512i even = load_v_chunk<NC>(v_rows[t], j);
      const __m512i odd = t + 1 < n ? load_v_chunk<NC>(v_rows[t + 1], j) : _mm512_setzero_si512();
      v[2 * j] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(even, odd));
      v[2 * j + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(even, odd));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_of(r, t)));
      for (int c = 0; c < 2 * kPairs; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], p);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 2 * kPairs; ++c) vstore(acc + r * acc_len + 16 * c, a[r][c]);
  }
}

template <int NC>
inline void unpermute_pairs(float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < (NC + 1) / 2; ++j) {
    const Vec16 lo = vload(acc + 32 * j), hi = vload(acc + 32 * j + 16);
    vstore(acc + 32 * j, _mm512_permutex2var_ps(lo, first, hi));
    vstore(acc + 32 * j + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

#else  // AVX-512 without AVX512_BF16

// Attention rows (per kv head) from which a bf16 query's work item runs on fp32 rows, its
// K/V widened once a visit (attention_kernel.h, kWidenBf16Rows). On this tier (Zen 5, 2026-11-26)
// widening made a 4,096-token prefill's attention 1.16x faster (15 rows an item) and decode
// (3 rows) 8-15% slower (probably because a 16-lane widening in the product costs little
// beside a copy through L1 that only 3 rows share; not profiled).
constexpr int kWidenBf16FromRows = 8;

// The even (odd) elements of 16 bf16 pairs, widened: a 16-bit shift (a mask) of each pair.
inline Vec16 vload_even(const uint16_t* pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(pairs), 16));
}
inline Vec16 vload_odd(const uint16_t* pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(pairs), _mm512_set1_epi32(int(0xFFFF0000u))));
}

#include "simd_bf16_emulated.h"

#endif  // CONTBATCH_AVX512_BF16
