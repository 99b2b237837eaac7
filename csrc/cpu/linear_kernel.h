// The bf16 linear kernel over panel-packed weights (layout: linear_kernel_api.h), written
// against the tier's accumulate_pair_row (vdpbf16ps on AVX512_BF16 in simd_avx512.h, bf16
// widened to fp32 elsewhere in simd_bf16_emulated.h) and included after layers_kernel.h
// (load1 / store1) and linear_tiles.h. Products of bf16 are exact and sums are fp32; the result is rounded to
// bf16 once, after the bias.
//
// A row tile of kLinearTileRows rows runs over the panel's columns in tiles of
// kLinearTileVectors vectors: each weight load feeds kLinearTileRows dot products, and the
// accumulators, weight vectors and a broadcast input fit the tier's registers. Its input
// pairs are broadcast from the rows as they are where the tier multiplies bf16 pairs
// (kPairsBroadcastAsStored), else staged first (stage_pair: the pair widened to fp32).
//
// Tiers without bf16 dot products (CONTBATCH_WIDENS_PANELS) also have a widened kernel,
// linear_bf16_widened: it widens the whole panel to fp32 first, so every weight is widened
// once per call instead of once per row tile, and the inner loop is plain fp32 loads,
// broadcasts and FMAs, for runs of kWidenFromRows rows or more (fewer take the direct loop).
// The driver (linear.cpp) calls it on CPUs where it pays (cpu_isa.h). Both kernels add each
// pair's odd product before its even one (accumulate_pair_row's order), so a row's result
// does not depend on which one ran it: runs follow the split of a call over the threads
// (panel_runs.h), and with the orders apart a greedy token could change with the thread
// count, which follows the machine's load (contbatch/engine/threads.py).

static_assert(kLinearTileRows <= kMaxLinearTileRows && sizeof(StagedPair) <= 8, "linear scratch too small");
constexpr int kTileColumns = kLinearTileVectors * kLanes;
static_assert(kPanelColumns % kTileColumns == 0, "column tiles must divide a panel");
constexpr int64_t kWidenFromRows = 2 * kLinearTileRows;

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

// out[MR, columns] from the rows' input pairs (pair_at(k, m): row m's pair k, as staged)
// and the panel's pair rows starting at `weights` (the tile's first column).
template <int MR, class PairAt>
inline void linear_tile(const PairAt& pair_at, int64_t pairs, const uint16_t* weights, const uint16_t* bias,
                        uint16_t* out, int64_t out_stride, int64_t columns) {
  Vec16 acc[MR][kLinearTileVectors];
  for (int m = 0; m < MR; ++m) {
    for (Vec16& a : acc[m]) a = vzero();
  }
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* pair_row = weights + k * 2 * kPanelColumns;
    for (int v = 0; v < kLinearTileVectors; ++v) prefetch_panel_ahead(pair_row + 2 * kLanes * v);
    accumulate_pair_row<MR, kLinearTileVectors>(acc, pair_row, [&](int m) { return pair_at(k, m); });
  }
  store_tile(acc, bias, out, out_stride, columns);
}

// The column tiles of one panel, one tile of `tile` rows. Where staging would change
// nothing (kPairsBroadcastAsStored) and every pair is whole, the pairs are broadcast from the
// rows where they are: staging a tile's rows again for every panel took about a fifth of a
// 256-row call (Zen 5). Otherwise the inputs are staged by stage_rows.
template <class Tile>
inline void direct_row_tile(Tile, const uint16_t* x, int64_t x_stride, int64_t in_features, const uint16_t* panel,
                            const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns,
                            StagedPair* staged) {
  constexpr int MR = Tile::size;
  const int64_t pairs = (in_features + 1) / 2;
  const auto run_tiles = [&](const auto& pair_at) {
    for_column_tiles<kTileColumns>(columns, [&](int64_t c0, int64_t width) {
      linear_tile<MR>(pair_at, pairs, panel + 2 * c0, bias == nullptr ? nullptr : bias + c0, out + c0, out_stride,
                      width);
    });
  };
  if constexpr (kPairsBroadcastAsStored) {
    if (in_features % 2 == 0) {
      return run_tiles([&](int64_t k, int m) { return stage_pair(load_pair_bits(x + m * x_stride + 2 * k)); });
    }
  }
  stage_rows<MR>(staged, x, x_stride, in_features);
  run_tiles([&](int64_t k, int m) { return staged[k * MR + m]; });
}

void linear_bf16_panel(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                       const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns, void* scratch) {
  auto* staged = reinterpret_cast<StagedPair*>(static_cast<char*>(scratch) + kLinearScratchHeader);
  for_row_tiles<kLinearTileRows>(rows, [&](auto tile, int64_t r) {
    direct_row_tile(tile, x + r * x_stride, x_stride, in_features, panel, bias, out + r * out_stride, out_stride,
                    columns, staged);
  });
}

#ifdef CONTBATCH_WIDENS_PANELS
// Input i of a widened panel's order: each pair's odd input first (accumulate_pair_row's order).
constexpr int64_t widened_input(int64_t i) { return i ^ 1; }

// wide[i][c] = the weight of column c for input widened_input(i), as fp32, for the 2 * pairs
// inputs (input 2 * pairs - 1 zero where in_features is odd: the panel's padding).
inline void widen_panel(float* wide, const uint16_t* panel, int64_t pairs) {
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* pair_row = panel + k * 2 * kPanelColumns;
    float* odd = wide + 2 * k * kPanelColumns;
    float* even = odd + kPanelColumns;
    for (int v = 0; v < kPanelColumns / kLanes; ++v) {
      vstore(even + kLanes * v, vload_even(pair_row + 2 * kLanes * v));
      vstore(odd + kLanes * v, vload_odd(pair_row + 2 * kLanes * v));
    }
  }
}

// staged[i * MR + m] = row m's input widened_input(i) as fp32, zero past in_features up to `inputs`.
template <int MR>
inline void stage_rows_fp32(float* staged, const uint16_t* x, int64_t x_stride, int64_t in_features, int64_t inputs) {
  for (int m = 0; m < MR; ++m) {
    const uint16_t* row = x + m * x_stride;
    for (int64_t i = 0; i < inputs; ++i) {
      const int64_t input = widened_input(i);
      staged[i * MR + m] = input < in_features ? load1(row[input]) : 0.0f;
    }
  }
}

// out[MR, columns] from fp32 staged rows and the widened panel from column `wide` on.
template <int MR>
inline void wide_tile(const float* staged, int64_t inputs, const float* wide, const uint16_t* bias, uint16_t* out,
                      int64_t out_stride, int64_t columns) {
  constexpr int NV = kLinearTileVectors;
  Vec16 acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (Vec16& a : acc[m]) a = vzero();
  }
  for (int64_t i = 0; i < inputs; ++i) {
    Vec16 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = vload(wide + i * kPanelColumns + kLanes * v);
    for (int m = 0; m < MR; ++m) {
      const Vec16 input = vset1(staged[i * MR + m]);
      for (int v = 0; v < NV; ++v) acc[m][v] = vfma(w[v], input, acc[m][v]);
    }
  }
  store_tile(acc, bias, out, out_stride, columns);
}

template <class Tile>
inline void wide_row_tile(Tile, const uint16_t* x, int64_t x_stride, int64_t in_features, const float* wide,
                          int64_t inputs, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns,
                          float* staged) {
  constexpr int MR = Tile::size;
  stage_rows_fp32<MR>(staged, x, x_stride, in_features, inputs);
  for_column_tiles<kTileColumns>(columns, [&](int64_t c0, int64_t width) {
    wide_tile<MR>(staged, inputs, wide + c0, bias == nullptr ? nullptr : bias + c0, out + c0, out_stride, width);
  });
}

// Scratch: the header (which panel `wide` holds), the staged rows (kMaxLinearTileRows x 8
// bytes a pair), then the widened panel, kept for the thread's next task on the same panel.
void linear_bf16_widened(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                         const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns, void* scratch) {
  if (rows < kWidenFromRows) {
    return linear_bf16_panel(x, x_stride, rows, in_features, panel, bias, out, out_stride, columns, scratch);
  }
  const int64_t pairs = (in_features + 1) / 2, inputs = 2 * pairs;
  auto** widened_panel = static_cast<const uint16_t**>(scratch);
  auto* staged = reinterpret_cast<float*>(static_cast<char*>(scratch) + kLinearScratchHeader);
  float* wide = staged + pairs * kMaxLinearTileRows * 2;
  if (*widened_panel != panel) {
    widen_panel(wide, panel, pairs);
    *widened_panel = panel;
  }
  for_row_tiles<kLinearTileRows>(rows, [&](auto tile, int64_t r) {
    wide_row_tile(tile, x + r * x_stride, x_stride, in_features, wide, inputs, bias, out + r * out_stride,
                  out_stride, columns, staged);
  });
}
#endif  // CONTBATCH_WIDENS_PANELS

