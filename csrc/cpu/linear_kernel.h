// The bf16 linear kernel over panel-packed weights (layout: linear_kernel_api.h), written
// against the pair-dot operations of simd_avx512.h / simd_generic.h (vdpbf16ps on
// AVX512_BF16) and included after layers_kernel.h (load1 / store1). Products of bf16
// pairs are exact and sums are fp32; the result is rounded to bf16 once, after the bias.

// 6 rows x 64 columns: 24 accumulators, 4 weight vectors and a broadcast input pair fit
// the 32 vector registers, and each weight load feeds 6 dot products.
constexpr int kLinearTileRows = 6;

inline uint32_t load_pair_bits(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

// acc[m] += the pair row w (64 columns x 2 inputs) times row m's input pair pair_of(m).
template <int MR, class PairOf>
inline void dot_pair_row(Vec16 (&acc)[MR][kPanelColumns / kLanes], const uint16_t* w, PairOf pair_of) {
  const PairVec w0 = vload_pairs(w), w1 = vload_pairs(w + 32), w2 = vload_pairs(w + 64), w3 = vload_pairs(w + 96);
  for (int m = 0; m < MR; ++m) {
    const InputPair a = vbroadcast_pair(pair_of(m));
    acc[m][0] = vdot_pairs(acc[m][0], w0, a);
    acc[m][1] = vdot_pairs(acc[m][1], w1, a);
    acc[m][2] = vdot_pairs(acc[m][2], w2, a);
    acc[m][3] = vdot_pairs(acc[m][3], w3, a);
  }
}

template <int MR>
inline void linear_tile(const uint16_t* x, int64_t x_stride, int64_t in_features, const uint16_t* panel,
                        const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns) {
  static_assert(kPanelColumns == 4 * kLanes, "dot_pair_row reads a panel row as 4 vectors");
  Vec16 acc[MR][kPanelColumns / kLanes];
  for (int m = 0; m < MR; ++m) {
    for (Vec16& a : acc[m]) a = vzero();
  }
  const int64_t full_pairs = in_features / 2;
  for (int64_t k = 0; k < full_pairs; ++k) {
    dot_pair_row<MR>(acc, panel + k * 2 * kPanelColumns,
                     [&](int m) { return load_pair_bits(x + m * x_stride + 2 * k); });
  }
  if (in_features % 2 == 1) {  // the last input pairs with 0 (and the panel's zero padding)
    dot_pair_row<MR>(acc, panel + full_pairs * 2 * kPanelColumns,
                     [&](int m) { return uint32_t(x[m * x_stride + in_features - 1]); });
  }
  alignas(64) float tile[kPanelColumns];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kPanelColumns / kLanes; ++v) vstore(tile + kLanes * v, acc[m][v]);
    uint16_t* row = out + m * out_stride;
    int64_t c = 0;
    for (; c + kLanes <= columns; c += kLanes) {
      const Vec16 sum = vload(tile + c);
      vstore(row + c, bias == nullptr ? sum : vadd(sum, vload(bias + c)));
    }
    for (; c < columns; ++c) store1(row + c, tile[c] + (bias == nullptr ? 0.0f : load1(bias[c])));
  }
}

void linear_bf16_panel(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                       const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns) {
  int64_t r = 0;
  for (; r + kLinearTileRows <= rows; r += kLinearTileRows) {
    linear_tile<kLinearTileRows>(x + r * x_stride, x_stride, in_features, panel, bias, out + r * out_stride,
                                 out_stride, columns);
  }
  const uint16_t* xr = x + r * x_stride;
  uint16_t* outr = out + r * out_stride;
  switch (rows - r) {
    case 1: linear_tile<1>(xr, x_stride, in_features, panel, bias, outr, out_stride, columns); break;
    case 2: linear_tile<2>(xr, x_stride, in_features, panel, bias, outr, out_stride, columns); break;
    case 3: linear_tile<3>(xr, x_stride, in_features, panel, bias, outr, out_stride, columns); break;
    case 4: linear_tile<4>(xr, x_stride, in_features, panel, bias, outr, out_stride, columns); break;
    case 5: linear_tile<5>(xr, x_stride, in_features, panel, bias, outr, out_stride, columns); break;
    default: break;
  }
}
