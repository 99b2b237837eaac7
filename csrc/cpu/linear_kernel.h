// The bf16 linear kernel over panel-packed weights (layout: linear_kernel_api.h), written
// against the tier's accumulate_pair_row (vdpbf16ps on AVX512_BF16 in simd_avx512.h, bf16
// widened to fp32 elsewhere in simd_bf16_emulated.h) and included after layers_kernel.h
// (load1 / store1). Products of bf16 pairs are exact and sums are fp32; the result is
// rounded to bf16 once, after the bias.
//
// A row tile of kLinearTileRows rows first stages its inputs pair by pair (stage_pair: the
// raw bits, or the pair widened to fp32), then runs over the panel's columns in tiles of
// kLinearTileVectors vectors: each weight load feeds kLinearTileRows dot products, and
// the accumulators, weight vectors and a broadcast input pair fit the tier's registers.

static_assert(kLinearTileRows <= kMaxLinearTileRows && sizeof(StagedPair) <= 8, "linear scratch too small");
constexpr int kTileColumns = kLinearTileVectors * kLanes;
static_assert(kPanelColumns % kTileColumns == 0, "column tiles must divide a panel");

inline uint32_t load_pair_bits(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

// staged[k * MR + m] = row m's input pair k; an odd last input pairs with 0 (and the
// panel's zero padding).
template <int MR>
inline void stage_rows(StagedPair* staged, const uint16_t* x, int64_t x_stride, int64_t in_features) {
  const int64_t full_pairs = in_features / 2;
  for (int m = 0; m < MR; ++m) {
    const uint16_t* row = x + m * x_stride;
    for (int64_t k = 0; k < full_pairs; ++k) staged[k * MR + m] = stage_pair(load_pair_bits(row + 2 * k));
    if (in_features % 2 == 1) staged[full_pairs * MR + m] = stage_pair(uint32_t(row[in_features - 1]));
  }
}

// out[MR, columns] (columns <= kTileColumns) from the staged rows and the panel's pair rows
// starting at `weights` (the tile's first column).
template <int MR>
inline void linear_tile(const StagedPair* staged, int64_t pairs, const uint16_t* weights, const uint16_t* bias,
                        uint16_t* out, int64_t out_stride, int64_t columns) {
  constexpr int NV = kLinearTileVectors;
  Vec16 acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (Vec16& a : acc[m]) a = vzero();
  }
  for (int64_t k = 0; k < pairs; ++k) accumulate_pair_row<MR, NV>(acc, weights + k * 2 * kPanelColumns, staged + k * MR);
  alignas(64) float tile[kTileColumns];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) vstore(tile + kLanes * v, acc[m][v]);
    uint16_t* row = out + m * out_stride;
    int64_t c = 0;
    for (; c + kLanes <= columns; c += kLanes) {
      const Vec16 sum = vload(tile + c);
      vstore(row + c, bias == nullptr ? sum : vadd(sum, vload(bias + c)));
    }
    for (; c < columns; ++c) store1(row + c, tile[c] + (bias == nullptr ? 0.0f : load1(bias[c])));
  }
}

template <int MR>
inline void linear_row_tile(const uint16_t* x, int64_t x_stride, int64_t in_features, const uint16_t* panel,
                            const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns,
                            StagedPair* staged) {
  stage_rows<MR>(staged, x, x_stride, in_features);
  const int64_t pairs = (in_features + 1) / 2;
  for (int64_t c0 = 0; c0 < columns; c0 += kTileColumns) {
    const int64_t width = columns - c0 < kTileColumns ? columns - c0 : kTileColumns;
    linear_tile<MR>(staged, pairs, panel + 2 * c0, bias == nullptr ? nullptr : bias + c0, out + c0, out_stride,
                    width);
  }
}

// The last rows of a call, fewer than a whole tile: MR = rows, found by counting down.
template <int MR>
inline void linear_last_rows(int64_t rows, const uint16_t* x, int64_t x_stride, int64_t in_features,
                             const uint16_t* panel, const uint16_t* bias, uint16_t* out, int64_t out_stride,
                             int64_t columns, StagedPair* staged) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      return linear_row_tile<MR>(x, x_stride, in_features, panel, bias, out, out_stride, columns, staged);
    }
    linear_last_rows<MR - 1>(rows, x, x_stride, in_features, panel, bias, out, out_stride, columns, staged);
  }
}

void linear_bf16_panel(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                       const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns, void* scratch) {
  auto* staged = static_cast<StagedPair*>(scratch);
  int64_t r = 0;
  for (; r + kLinearTileRows <= rows; r += kLinearTileRows) {
    linear_row_tile<kLinearTileRows>(x + r * x_stride, x_stride, in_features, panel, bias, out + r * out_stride,
                                     out_stride, columns, staged);
  }
  linear_last_rows<kLinearTileRows - 1>(rows - r, x + r * x_stride, x_stride, in_features, panel, bias,
                                        out + r * out_stride, out_stride, columns, staged);
}
