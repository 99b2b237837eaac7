// Portable 16-lane fp32 vector: plain loops the compiler vectorises for the baseline ISA.
// Same functions as simd_avx2.h and simd_avx512.h; included only by kernels_generic.cpp,
// inside an anonymous namespace.
#pragma once

struct Vec16 {
  float v[16];
};
using Mask16 = uint32_t;

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof f);
  if (std::isnan(f)) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline Vec16 vset1(float x) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline Vec16 vzero() { return vset1(0.0f); }
inline Vec16 vload(const float* p) {
  Vec16 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline Vec16 vload(const uint16_t* bf16) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_float(bf16[i]);
  return r;
}
inline Vec16 vload(const int8_t* p) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void vstore(float* p, Vec16 v) { std::memcpy(p, v.v, sizeof v.v); }
inline void vstore(uint16_t* bf16, Vec16 v) {
  for (int i = 0; i < 16; ++i) bf16[i] = float_to_bf16(v.v[i]);
}

#define CONTBATCH_LANEWISE(name, expr)        \
  inline Vec16 name(Vec16 a, Vec16 b) {       \
    Vec16 r;                                  \
    for (int i = 0; i < 16; ++i) r.v[i] = expr; \
    return r;                                 \
  }
CONTBATCH_LANEWISE(vadd, a.v[i] + b.v[i])
CONTBATCH_LANEWISE(vsub, a.v[i] - b.v[i])
CONTBATCH_LANEWISE(vmul, a.v[i] * b.v[i])
CONTBATCH_LANEWISE(vdiv, a.v[i] / b.v[i])
#undef CONTBATCH_LANEWISE

inline Vec16 vfma(Vec16 a, Vec16 b, Vec16 c) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline Vec16 vmask_fill(Mask16 keep, Vec16 v, float fill) {
  for (int i = 0; i < 16; ++i) v.v[i] = (keep >> i) & 1 ? v.v[i] : fill;
  return v;
}
inline Vec16 vmaskz(Mask16 keep, Vec16 v) { return vmask_fill(keep, v, 0.0f); }
inline float vreduce_max(Vec16 v) {
  float m = v.v[0];
  for (int i = 1; i < 16; ++i) m = v.v[i] > m ? v.v[i] : m;
  return m;
}
inline float vreduce_add(Vec16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v.v[i];
  return s;
}
inline Mask16 vgreater(Vec16 a, float b) {
  Mask16 m = 0;
  for (int i = 0; i < 16; ++i) m |= Mask16(a.v[i] > b) << i;
  return m;
}
inline Mask16 vequal(Vec16 a, float b) {
  Mask16 m = 0;
  for (int i = 0; i < 16; ++i) m |= Mask16(a.v[i] == b) << i;
  return m;
}
inline Mask16 visnan(Vec16 a) {
  Mask16 m = 0;
  for (int i = 0; i < 16; ++i) m |= Mask16(std::isnan(a.v[i])) << i;
  return m;
}
inline Vec16 vmax(Vec16 a, Vec16 b) {  // b where either is NaN, as _mm512_max_ps
  for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline Vec16 vexp2(Vec16 x) {
  for (int i = 0; i < 16; ++i) x.v[i] = std::exp2(x.v[i]);
  return x;
}

constexpr int kLanes = 16;

// Vec16s that fit the vector registers: this tier is plain C++, so a nominal figure.
constexpr int kVectorRegisters = 32;
// Attention rows from which a bf16 query's work item runs on fp32 rows (attention_kernel.h,
// kWidenBf16Rows): always, as on AVX2 (not measured on this tier: its widening is scalar code).
constexpr int kWidenBf16FromRows = 1;
// Whether an item over widened rows loads its blocks ahead (attention_kernel.h, BlockLoader):
// yes (not measured on this tier).
constexpr bool kLoadAheadOfWidenedRows = true;

// 6 rows x 64 columns per linear tile (linear_kernel.h).
constexpr int kLinearTileRows = 6;
constexpr int kLinearTileVectors = 4;

inline Vec16 vload_even(const uint16_t* pairs) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_float(pairs[2 * i]);
  return r;
}
inline Vec16 vload_odd(const uint16_t* pairs) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_float(pairs[2 * i + 1]);
  return r;
}

#include "simd_bf16_emulated.h"

template <int NC, class T>
inline Vec16 qk_tile(const T* q, const T* const* k_rows) {
  Vec16 r;
  for (int t = 0; t < 16; ++t) {
    Vec16 acc = vzero();
    for (int c = 0; c < NC; ++c) acc = vfma(vload(q + 16 * c), vload(k_rows[t] + 16 * c), acc);
    r.v[t] = vreduce_add(acc);
  }
  return r;
}
