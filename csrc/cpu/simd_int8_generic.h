// The int8 section (int8_linear_kernel.h) in portable C++: int32 sums of the stored weights
// (q + o: int8_kernel_api.h) times the int8 inputs, from the row's block offset, one column at a time.
// Included after simd_generic.h.
#pragma once

using I8Input = uint32_t;  // the row's 4 int8 inputs
struct I8Acc {
  int32_t columns[16];
};
using I8Weights = const uint8_t*;

constexpr int kI8TileRows = 4;
constexpr int kI8TileVectors = 4;
constexpr int kI8WholePanelRows = 0;  // no tile spans the panel (int8_linear_kernel.h)
constexpr int kI8WholePanelRunRows = 0;
constexpr int kI8WholePanelGroup = 1;
constexpr int kI8WholePanelRegisterRows = kI8WholePanelRows;  // sums in registers
constexpr bool kI8LoneTileWithoutPrefetch = false;  // no tile spans the panel

#define CONTBATCH_I8_QUAD_UNROLL 1
inline I8Input i8_input(const int8_t* x) {
  I8Input quad;
  std::memcpy(&quad, x, sizeof quad);
  return quad;
}
inline I8Acc i8_start(int32_t offset) {
  I8Acc acc;
  for (int32_t& column : acc.columns) column = offset;
  return acc;
}
inline I8Weights i8_load(const uint8_t* w) { return w; }
inline void i8_dot(I8Acc& acc, I8Weights w, I8Input x) {
  int8_t inputs[4];
  std::memcpy(inputs, &x, sizeof inputs);
  for (int c = 0; c < 16; ++c) {
    for (int i = 0; i < 4; ++i) acc.columns[c] += int32_t(w[4 * c + i]) * int32_t(inputs[i]);
  }
}
inline Vec16 i8_finish(const I8Acc& acc) {
  Vec16 r;
  for (int c = 0; c < 16; ++c) r.v[c] = float(acc.columns[c]);
  return r;
}
// IEEE half to float: normal, subnormal, zero, inf and NaN.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 0x1F) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= sign;
  std::memcpy(&magnitude, &bits, sizeof bits);
  return magnitude;
}
inline Vec16 vload_f16(const uint16_t* h) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(h[i]);
  return r;
}
inline void i8_store_rounded(int8_t* q, Vec16 v) {  // |v| <= 127 by construction
  for (int i = 0; i < 16; ++i) q[i] = int8_t(std::nearbyint(v.v[i]));
}
