// 16-lane fp32 vector operations on AVX2 + FMA: a Vec16 is two 8-lane halves, so the
// kernels written against Vec16 (16 key positions a chunk, 16-bit lane masks) run
// unchanged. AVX2 has no bf16 arithmetic: bf16 is widened to fp32 by a 16-bit shift and
// rounded back with integer ops (simd_bf16_emulated.h for the linear kernel). Included only
// by kernels_avx2.cpp, inside its `#pragma GCC target` region and an anonymous namespace.
#pragma once

struct Vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
using Mask16 = uint32_t;

constexpr int kLanes = 16;
// Vec16s that fit the 16 ymm registers: the attention kernel sizes its register blocks by it.
constexpr int kVectorRegisters = 8;
// Attention rows (per kv head) from which a bf16 query's work item runs on fp32 rows, its
// K/V widened once a visit (attention_kernel.h, kWidenBf16Rows): always here. Widening in every
// product cost a 4,096-token prefill's attention 1.4-1.5x and decode 5-8% (Zen 5, AVX2 tier).
constexpr int kWidenBf16FromRows = 1;
// Whether an item over widened rows (a bf16 or int8 cache) loads its blocks ahead of its visits
// (attention_kernel.h, BlockLoader): not here. On Zen 3 (2026-12-03) decode over those caches
// is bound by its arithmetic (a bf16 cache read from L3 streamed 16-20 GB/s, not much above
// DRAM's 11-17), and the loads ahead cost more than they hid: without them bf16 decode took
// 0.82-0.93x the time, the int8 cache's 0.83-0.97x; fp32 caches keep them (1.3x faster).
constexpr bool kLoadAheadOfWidenedRows = false;

inline __m256 bf16x8_to_float(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Round to nearest even, NaN stays NaN (quiet): the rule of simd_generic.h's float_to_bf16.
inline __m128i float8_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // Every lane is below 2^16, so packus keeps it; it packs within 128-bit halves, and the
  // permute gathers the two halves' low 64 bits.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline Vec16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec16 vload(const uint16_t* bf16) { return {bf16x8_to_float(bf16), bf16x8_to_float(bf16 + 8)}; }
inline Vec16 vload(const int8_t* p) {  // 16 signed bytes, exactly
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline void vstore(float* p, Vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void vstore(uint16_t* bf16, Vec16 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bf16), float8_to_bf16(v.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bf16 + 8), float8_to_bf16(v.hi));
}

#define CONTBATCH_HALVES(name, op) \
  inline Vec16 name(Vec16 a, Vec16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
CONTBATCH_HALVES(vadd, _mm256_add_ps)
CONTBATCH_HALVES(vsub, _mm256_sub_ps)
CONTBATCH_HALVES(vmul, _mm256_mul_ps)
CONTBATCH_HALVES(vdiv, _mm256_div_ps)  // IEEE-exact, as scalar division
CONTBATCH_HALVES(vmax, _mm256_max_ps)  // b where either is NaN
#undef CONTBATCH_HALVES

inline Vec16 vfma(Vec16 a, Vec16 b, Vec16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

// All-ones in lane i of 8 where bit i of `bits` is set.
inline __m256 lane_mask8(uint32_t bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), bit), bit));
}
inline Vec16 vmask_fill(Mask16 keep, Vec16 v, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, v.lo, lane_mask8(keep)), _mm256_blendv_ps(f, v.hi, lane_mask8(keep >> 8))};
}
inline Vec16 vmaskz(Mask16 keep, Vec16 v) {
  return {_mm256_and_ps(v.lo, lane_mask8(keep)), _mm256_and_ps(v.hi, lane_mask8(keep >> 8))};
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float vreduce_max(Vec16 v) { return hmax8(_mm256_max_ps(v.lo, v.hi)); }
inline float vreduce_add(Vec16 v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <int kPredicate>
inline Mask16 vcompare(Vec16 a, Vec16 b) {
  return Mask16(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kPredicate))) |
         Mask16(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kPredicate))) << 8;
}
inline Mask16 vgreater(Vec16 a, float b) { return vcompare<_CMP_GT_OQ>(a, vset1(b)); }
inline Mask16 vequal(Vec16 a, float b) { return vcompare<_CMP_EQ_OQ>(a, vset1(b)); }
inline Mask16 visnan(Vec16 a) { return vcompare<_CMP_UNORD_Q>(a, a); }

#include "simd_exp2.h"

// 2^n for n = round(x) in [-150, 128] applied as two factors 2^(n >> 1) and 2^(n - (n >> 1)),
// each a normal float, so the result underflows to subnormals and 0 and overflows to inf
// as AVX-512's scalef does.
inline __m256 scale_by_exp2(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_srai_epi32(ni, 1), second = _mm256_sub_epi32(ni, first);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 scale2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, scale1), scale2);
}
inline __m256 clamp_exponent(__m256 x) {
  return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-150.0f)), _mm256_set1_ps(128.0f));
}
inline __m256 round_nearest(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2 (simd_exp2.h), as simd_avx512.h computes it.
inline Vec16 vexp2(Vec16 x) {
  x = {clamp_exponent(x.lo), clamp_exponent(x.hi)};
  const Vec16 n = {round_nearest(x.lo), round_nearest(x.hi)};
  const Vec16 p = exp2_fraction(vsub(x, n));
  return {scale_by_exp2(p.lo, n.lo), scale_by_exp2(p.hi, n.hi)};
}

// Lane t of the result is the sum of the lanes of v[t], for 8 vectors.
inline __m256 sum_transpose8(const __m256 v[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 holds the sums of v[0..3] over lanes 0-3 in its low half and over lanes 4-7 in its high half.
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return bf16x8_to_float(p); }

// Lane t: dot(q, k_rows[t]) over 16 * NC elements, for 16 key rows, 8 rows at a time so
// that the 8 accumulators, a query vector and a key vector fit the 16 registers.
template <int NC, class T>
inline Vec16 qk_tile(const T* q, const T* const* k_rows) {
  __m256 halves[2];
  for (int g = 0; g < 2; ++g) {
    __m256 acc[8];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    for (int c = 0; c < 2 * NC; ++c) {
      const __m256 qc = load8(q + 8 * c);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qc, load8(k_rows[8 * g + t] + 8 * c), acc[t]);
    }
    halves[g] = sum_transpose8(acc);
  }
  return {halves[0], halves[1]};
}

// 5 rows x 16 columns per linear tile (linear_kernel.h): 10 accumulator, 2 weight and 1
// broadcast input registers of the 16. At 6 rows GCC spills an accumulator every iteration
// (a store-to-load chain that halved the kernel's speed).
constexpr int kLinearTileRows = 5;
constexpr int kLinearTileVectors = 1;

// The even (odd) elements of 16 bf16 pairs, widened: a 16-bit shift (a mask) of each pair.
inline Vec16 vload_even(const uint16_t* pairs) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline Vec16 vload_odd(const uint16_t* pairs) {
  const __m256i odd_bits = _mm256_set1_epi32(int(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16));
  return {_mm256_castsi256_ps(_mm256_and_si256(lo, odd_bits)), _mm256_castsi256_ps(_mm256_and_si256(hi, odd_bits))};
}

#include "simd_bf16_emulated.h"
