// Row kernels of the fused layer ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul,
// rotary embedding) and of the greedy sampler's argmax, written once against the Vec16
// API and included by every kernels_<tier>.cpp (through kernel_tier.h) inside an
// anonymous namespace, after the tier's simd header. T is float or uint16_t (bf16 bits); arithmetic is fp32.
//
// Rounding follows PyTorch's op-by-op evaluation of the same formulas (contbatch/ops/
// reference.py) so that bf16 results agree with HF transformers: wherever PyTorch would
// materialise a bf16 tensor between two ops, `round_as<T>` rounds to bf16 here too.

inline float load1(float x) { return x; }
inline float load1(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store1(float* p, float x) { *p = x; }
inline void store1(uint16_t* p, float f) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof f);
  *p = std::isnan(f) ? uint16_t((bits >> 16) | 0x40) : uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

template <class T>
inline float round_as(float x) {
  T t;
  store1(&t, x);
  return load1(t);
}
template <class T>
inline Vec16 round_as(Vec16 v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    T tmp[kLanes];
    vstore(tmp, v);
    return vload(tmp);
  }
}

// sum(x^2) over n elements.
template <class T>
inline float sum_of_squares(const T* x, int64_t n) {
  Vec16 acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec16 v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  float sum = vreduce_add(acc);
  for (; i < n; ++i) sum += load1(x[i]) * load1(x[i]);
  return sum;
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)); out may alias x.
template <class T>
inline void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_of_squares(x, n) / float(n) + eps);
  const Vec16 vr = vset1(r);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vstore(out + i, vmul(vload(weight + i), round_as<T>(vmul(vload(x + i), vr))));
  }
  for (; i < n; ++i) store1(out + i, load1(weight[i]) * round_as<T>(load1(x[i]) * r));
}

// residual = T(residual + x); x = rms_norm(residual).
template <class T>
inline void add_rms_norm_row(T* x, T* residual, const T* weight, int64_t n, float eps) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(residual + i, vadd(vload(residual + i), vload(x + i)));
  for (; i < n; ++i) store1(residual + i, load1(residual[i]) + load1(x[i]));
  rms_norm_row(x, residual, weight, n, eps);
}

// out = T(silu(gate)) * up, gate_up = [gate (d) | up (d)]; silu(g) = g / (1 + e^-g).
template <class T>
inline void silu_and_mul_row(T* out, const T* gate_up, int64_t d) {
  const T* up = gate_up + d;
  const Vec16 minus_log2e = vset1(-1.4426950408889634f), one = vset1(1.0f);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const Vec16 g = vload(gate_up + i);
    const Vec16 silu = vdiv(g, vadd(one, vexp2(vmul(g, minus_log2e))));  // exact division, as PyTorch
    vstore(out + i, vmul(round_as<T>(silu), vload(up + i)));
  }
  for (; i < d; ++i) {
    const float g = load1(gate_up[i]);
    store1(out + i, round_as<T>(g / (1.0f + std::exp(-g))) * load1(up[i]));
  }
}

// One head of rotate-half rotary embedding in place: with h = D / 2,
//   x[i]     = T(T(x[i] * cos[i]) + T(-x[i + h] * sin[i]))
//   x[i + h] = T(T(x[i + h] * cos[i + h]) + T(x[i] * sin[i + h]))
template <class T>
inline void rotary_head(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Vec16 x1 = vload(x + i), x2 = vload(x + half + i);
    const Vec16 lo = vsub(round_as<T>(vmul(x1, vload(cos + i))), round_as<T>(vmul(x2, vload(sin + i))));
    const Vec16 hi = vadd(round_as<T>(vmul(x2, vload(cos + half + i))), round_as<T>(vmul(x1, vload(sin + half + i))));
    vstore(x + i, lo);
    vstore(x + half + i, hi);
  }
  for (; i < half; ++i) {
    const float x1 = load1(x[i]), x2 = load1(x[half + i]);
    store1(x + i, round_as<T>(x1 * load1(cos[i])) - round_as<T>(x2 * load1(sin[i])));
    store1(x + half + i, round_as<T>(x2 * load1(cos[half + i])) + round_as<T>(x1 * load1(sin[half + i])));
  }
}

// Index of the first element of x[0, n) equal to `target`, or of the first NaN if target is NaN.
template <class T>
inline int64_t first_index_of(const T* x, int64_t n, float target) {
  const bool nan = std::isnan(target);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec16 v = vload(x + i);
    const Mask16 hit = nan ? visnan(v) : vequal(v, target);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i) {
    const float f = load1(x[i]);
    if (nan ? std::isnan(f) : f == target) return i;
  }
  return 0;  // unreachable for a target taken from x
}

// The greedy sampler's argmax of one row of logits: the first maximum, with NaN counting
// as larger than any number (torch.max's rule), in two passes over a row that stays in L2.
template <class T>
inline int64_t argmax_row(const T* x, int64_t n) {
  Vec16 best = vset1(-INFINITY);
  Mask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec16 v = vload(x + i);
    nan |= visnan(v);
    best = vmax(v, best);  // NaN lanes keep `best`: they are counted in `nan`
  }
  float top = vreduce_max(best);
  for (; i < n; ++i) {
    const float f = load1(x[i]);
    if (std::isnan(f)) nan = 1;
    top = f > top ? f : top;
  }
  return first_index_of(x, n, nan ? NAN : top);
}

// The sampler's first pass over a row: its largest value, NaN ignored; -inf when every token
// is masked out.
template <class T>
inline float row_max(const T* x, int64_t n) {
  Vec16 best = vset1(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) best = vmax(vload(x + i), best);  // NaN lanes keep `best`
  float top = vreduce_max(best);
  for (; i < n; ++i) {
    const float f = load1(x[i]);
    top = f > top ? f : top;
  }
  return top;
}

// The sampler's second pass: weights[i] = e^((x[i] - top) / temperature), computed as
// 2^((x[i] - top) * scale) with scale = log2(e) / temperature (1 at the row's maximum), set
// to 0 where it is not above `floor` (min-p) or x[i] is -inf or NaN; and the sum of each
// block of kSampleBlock weights, so that a draw reads one block of them, not the row.
template <class T>
inline void tempered_weights_row(const T* x, int64_t n, float top, float scale, float floor, float* weights,
                                 float* block_sums) {
  const Vec16 vtop = vset1(top), vscale = vset1(scale);
  for (int64_t begin = 0; begin < n; begin += kSampleBlock) {
    const int64_t end = n - begin < kSampleBlock ? n : begin + kSampleBlock;
    Vec16 sum = vzero();
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {  // kSampleBlock is a multiple of kLanes: a tail only at n
      const Vec16 v = vload(x + i);
      const Vec16 w = vexp2(vmul(vsub(v, vtop), vscale));
      const Vec16 kept = vmaskz(vgreater(v, -INFINITY) & vgreater(w, floor), w);
      vstore(weights + i, kept);
      sum = vadd(sum, kept);
    }
    float total = vreduce_add(sum);
    for (; i < end; ++i) {
      const float v = load1(x[i]), w = std::exp2((v - top) * scale);
      weights[i] = v > -INFINITY && w > floor ? w : 0.0f;
      total += weights[i];
    }
    block_sums[begin / kSampleBlock] = total;
  }
}

inline int64_t first_above(const float* x, int64_t begin, int64_t n, float bound) {
  int64_t i = begin;
  for (; i + kLanes <= n; i += kLanes) {
    const Mask16 hit = vgreater(vload(x + i), bound);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i) {
    if (x[i] > bound) return i;
  }
  return n;
}

template <class T>
constexpr LayerKernels<T> kLayerKernels{&rms_norm_row<T>, &add_rms_norm_row<T>, &silu_and_mul_row<T>, &rotary_head<T>,
                                        &argmax_row<T>,   &row_max<T>,          &tempered_weights_row<T>};
