// 2^f for |f| <= 1/2 as e^(f ln2) by its degree-7 Taylor polynomial (truncation error
// < 1e-8 relative), written against the tier's Vec16 vfma / vset1. Included by the simd
// headers of the x86 tiers after those functions; each scales the result by 2^n itself.
#pragma once

inline Vec16 exp2_fraction(Vec16 f) {
  Vec16 p = vset1(1.5252734e-05f);  // ln2^k / k!, k = 7 .. 0
  p = vfma(p, f, vset1(1.5403530e-04f));
  p = vfma(p, f, vset1(1.3333558e-03f));
  p = vfma(p, f, vset1(9.6181291e-03f));
  p = vfma(p, f, vset1(5.5504109e-02f));
  p = vfma(p, f, vset1(2.4022651e-01f));
  p = vfma(p, f, vset1(6.9314718e-01f));
  return vfma(p, f, vset1(1.0f));
}
