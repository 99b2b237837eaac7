// Register-tile helpers shared by the linear kernels (linear_kernel.h, int8_linear_kernel.h),
// written against the tier's Vec16 functions and layers_kernel.h's load1 / store1.

// With few rows a tile does little work per weight byte, and the hardware prefetcher alone
// left the linear kernels at 40-65% of the bandwidth a streaming read gets (4-8 rows, weights
// from DRAM). Prefetching the bytes 8 KiB further on in the panel into L1 as each is read
// made 4-8 rows 30-45% faster on every int8 kernel (AVX-512 VNNI, AVX-VNNI, AVX2) and 25-60%
// on every bf16 one, one row 5-40%; 1-4 KiB ahead, or into L2 only, was slower, and calls with
// 64+ rows (panels in L2) no different (Emerald Rapids Xeon, 2026-11-25).
constexpr int64_t kPanelPrefetchBytes = 8192;

inline void prefetch_panel_ahead(const void* weights) {
  __builtin_prefetch(static_cast<const char*>(weights) + kPanelPrefetchBytes, 0, 3);
}

// Into L2: the weights a later call (the next panel) reads, while this one reads from cache.
inline void prefetch_later_panel(const void* weights) { __builtin_prefetch(weights, 0, 2); }

template <int N>
struct TileRows {
  static constexpr int size = N;
};

// f(TileRows<rows>{}) for 1 <= rows <= MR: the row count as a compile-time constant.
template <int MR, class F>
inline void with_tile_rows(int64_t rows, const F& f) {
  if constexpr (MR > 0) {
    if (rows == MR) return f(TileRows<MR>{});
    with_tile_rows<MR - 1>(rows, f);
  }
}

// f(tile) for each row tile of `rows`, tiles of MR rows (a shorter last one), passing
// TileRows<n> and the tile's first row.
template <int MR, class F>
inline void for_row_tiles(int64_t rows, const F& f) {
  for (int64_t r = 0; r < rows; r += MR) {
    with_tile_rows<MR>(rows - r < MR ? rows - r : MR, [&](auto tile) { f(tile, r); });
  }
}

// As for_row_tiles, in as few tiles but of near-equal rows (MR and MR - 1 ...): 32 rows in
// tiles of 6 are 6, 6, 6, 6, 6 and 2, here 6, 6, 5, 5, 5 and 5, so no tile runs with so few
// rows that it waits on its loads rather than its multiply-adds.
template <int MR, class F>
inline void for_balanced_row_tiles(int64_t rows, const F& f) {
  const int64_t tiles = (rows + MR - 1) / MR;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t size = rows / tiles + (t < rows % tiles ? 1 : 0);
    with_tile_rows<MR>(size, [&](auto tile) { f(tile, r); });
    r += size;
  }
}

// tile(c0, width) for each column tile of WIDTH columns over `columns` (<= kPanelColumns).
template <int WIDTH, class F>
inline void for_column_tiles(int64_t columns, const F& tile) {
  for (int64_t c0 = 0; c0 < columns; c0 += WIDTH) {
    tile(c0, columns - c0 < WIDTH ? columns - c0 : WIDTH);
  }
}

// Adds the bias to the MR x NV accumulators and stores `columns` (<= NV * kLanes) of each
// row, rounded to T (fp32, or bf16 bits) once.
template <int MR, int NV, class T>
inline void store_tile(Vec16 (&acc)[MR][NV], const T* bias, T* out, int64_t out_stride, int64_t columns) {
  alignas(64) float tile[NV * kLanes];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) vstore(tile + kLanes * v, acc[m][v]);
    T* row = out + m * out_stride;
    int64_t c = 0;
    for (; c + kLanes <= columns; c += kLanes) {
      const Vec16 sum = vload(tile + c);
      vstore(row + c, bias == nullptr ? sum : vadd(sum, vload(bias + c)));
    }
    for (; c < columns; ++c) store1(row + c, tile[c] + (bias == nullptr ? 0.0f : load1(bias[c])));
  }
}
