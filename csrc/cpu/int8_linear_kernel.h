// The int8 linear kernel over block-quantized panels (layouts: int8_kernel_api.h), written
// once against the tier's Vec16 functions and its int8 section (simd_int8_*.h):
//   I8Input i8_input(const int8_t*)       a row's quad (4 inputs as staged), as i8_dot takes it
//   I8Acc i8_start(int32_t offset)        16 columns' int32 accumulators at a block's start:
//                                         the row's offset for the block in each (AVX2's,
//                                         which multiplies q itself, starts at zero)
//   I8Weights i8_load(const uint8_t*)     16 columns x 4 stored weights (q + 128) of a quad
//                                         row
//   i8_dot(I8Acc&, I8Weights, I8Input)    acc += the quad's dot product, per column
//   Vec16 i8_finish(I8Acc)                the 16 columns' block sums as fp32
//   Vec16 vload_f16(const uint16_t*)      16 fp16 scales
//   i8_store_rounded(int8_t*, Vec16)      16 values rounded half to even into int8
//   kI8TileRows, kI8TileVectors           the register tile: rows x 16-column vectors
//   kI8WholePanelRows, kI8WholePanelRunRows  tiles of at most the first span the panel, and
//                                         calls of at most the second rows run in them (0, 0:
//                                         never; see i8_tile_vectors and int8_row_tiles)
//   kI8WholePanelGroup                    vectors such a tile sums at once (i8_group_vectors)
//   kI8WholePanelRegisterRows             such tiles of more rows keep their fp32 sums over
//                                         blocks in L1, not in registers (i8_sums_in_memory)
//   kI8LoneTileWithoutPrefetch            whether the tier has panel_without_prefetch
//                                         (int8_kernel_api.h): a call of one such tile
//                                         without the prefetches ahead
//   CONTBATCH_I8_NARROW_QUADS             optional: a Quads (below) for narrow weights
//                                         (stored q + 64, |q| <= 64), where the section
//                                         reads them another way (AVX2's)
// Included after layers_kernel.h (load1 / store1) and linear_tiles.h.
//
// The block size (32 or 64 inputs, int8_kernel_api.h) is a template parameter: a 64-input
// block turns its int32 sums into fp32 once per 16 vpdpbusd rather than 8, the three vector
// operations of that finish being a quarter of a 32-input block's work at 256 rows.
//
// A row tile of kI8TileRows rows runs over the panel in column tiles of kI8TileVectors x 16
// (a tile of at most kI8WholePanelRows rows: the whole panel at once, see i8_tile_vectors),
// its input quads broadcast from the rows as the driver staged them (int8_kernel_api.h):
// per block, each row's accumulators start at its offset (-o x the block's input sum,
// which cancels the weights' +o: int8_kernel_api.h), each quad row of weights loaded once feeds every row of
// the tile, the block's int32 sums become fp32 once (times the two scales), and the fp32
// sums over blocks are rounded to the output type once.

// How a tile reads a quad row of weights and starts a block's sums: the section's own
// functions, for weights stored as q + 128 (and, where they add the offsets, q + 64 too).
struct I8StoredQuads {
  using Weights = I8Weights;
  static I8Acc start(int32_t offset) { return i8_start(offset); }
  static Weights load(const uint8_t* w) { return i8_load(w); }
};

#define CONTBATCH_PRAGMA_TEXT(text) #text
#define CONTBATCH_UNROLL(n) _Pragma(CONTBATCH_PRAGMA_TEXT(GCC unroll n))
constexpr int kI8TileColumns = kI8TileVectors * kLanes;
static_assert(kInt8PanelColumns % kI8TileColumns == 0, "column tiles must divide a panel");

// Column vectors of an MR-row tile. A tile narrower than the panel reads part of each quad
// row (kQuadRowBytes), so the panel is read in as many strided passes as it has column tiles;
// with few rows, bound by reading the weights, that left the hardware prefetcher and the
// prefetches ahead (linear_tiles.h) covering half the lines on each pass. A tile of at most
// kI8WholePanelRows rows spans the panel and reads it once, in address order.
template <int MR>
constexpr int i8_tile_vectors() {
  return MR <= kI8WholePanelRows ? kInt8PanelColumns / kLanes : kI8TileVectors;
}
// Vectors of an MR-row tile whose block sums are kept at once: all of them, or in a tile
// that spans the panel on a tier with few registers, kI8WholePanelGroup at a time (each
// group reading the block's quad rows again, in the same 2 KiB of the panel).
template <int MR>
constexpr int i8_group_vectors() {
  return MR <= kI8WholePanelRows ? kI8WholePanelGroup : kI8TileVectors;
}
// Whether an MR-row tile keeps its fp32 sums over blocks in an L1 array rather than in
// registers: a spanning tile of more rows than kI8WholePanelRegisterRows, whose block sums
// (MR x 4 int32 vectors) then have the registers to themselves. Each block's finish loads
// and stores the sums once, against 16 vpdpbusd a vector in a 64-input block.
template <int MR>
constexpr bool i8_sums_in_memory() {
  return MR <= kI8WholePanelRows && MR > kI8WholePanelRegisterRows;
}
constexpr int64_t kQuadRowBytes = kInt8PanelColumns * 4;
constexpr int64_t kInputQuadBytes = 4;  // a quad of int8 inputs
template <int BLOCK>
constexpr int64_t kBlockQuads = BLOCK / 4;

template <int N>
struct BlockInputs {
  static constexpr int size = N;
};

// f(BlockInputs<block_inputs>{}): a block size the kernels serve as a compile-time constant.
template <class F>
inline void with_block_inputs(int64_t block_inputs, const F& f) {
  if (block_inputs == kInt8WideBlock) return f(BlockInputs<kInt8WideBlock>{});
  f(BlockInputs<kInt8Q8Block>{});
}

// What a tile prefetches as it reads its quad rows (linear_tiles.h): with `ahead`, its own
// panel kPanelPrefetchBytes on, into L1 (the tile that reads the panel from memory); and into
// L2, `next_lines` 64-byte lines from `next` on, spread evenly over its steps (its share of
// the panel the thread reads next: int8_row_tiles_of).
struct I8TilePrefetch {
  bool ahead = true;
  const uint8_t* next = nullptr;
  int64_t next_lines = 0;
};

// out[MR, columns] for the column tile whose quad rows start at `values` (the stored
// bytes), its scales at `scales`; rows of staged inputs from x (x_stride bytes apart),
// their block scales and offsets from x_scales and x_offsets ([MR][blocks]); its prefetches
// as `prefetch` says (above).
template <int MR, int BLOCK, class Quads, class T>
inline void int8_tile(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets,
                      int64_t blocks, const uint8_t* values, const uint16_t* scales, const T* bias, T* out,
                      int64_t out_stride, int64_t columns, I8TilePrefetch prefetch) {
  constexpr int NV = i8_tile_vectors<MR>();
  constexpr bool kSumsInMemory = i8_sums_in_memory<MR>();
  Vec16 acc[MR][NV];
  alignas(64) float memory_sums[kSumsInMemory ? MR : 1][NV * kLanes];
  if constexpr (kSumsInMemory) {
    // Taking the array's address in an asm keeps GCC from turning it back into registers.
    asm volatile("" : : "r"(&memory_sums[0][0]) : "memory");
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < NV; ++v) vstore(memory_sums[m] + kLanes * v, vzero());
    }
  } else {
    for (int m = 0; m < MR; ++m) {
      for (Vec16& a : acc[m]) a = vzero();
    }
  }
  constexpr int G = i8_group_vectors<MR>();
  static_assert(NV % G == 0, "vector groups must divide the tile");
  // A step (a quad row of one group of vectors) prefetches a line of the next panel each time
  // its steps have been owed next_lines / steps of one.
  const int64_t steps = blocks * kBlockQuads<BLOCK> * (NV / G);
  int64_t owed = 0, next_line = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int g = 0; g < NV; g += G) {  // the block's quad rows, G vectors' columns at a time
      I8Acc block_acc[MR][G];
      for (int m = 0; m < MR; ++m) {
        const I8Acc start = Quads::start(x_offsets[m * blocks + b]);
        for (int v = 0; v < G; ++v) block_acc[m][v] = start;
      }
      CONTBATCH_UNROLL(CONTBATCH_I8_QUAD_UNROLL)  // the tier's choice (its int8 section says why)
      for (int q = 0; q < kBlockQuads<BLOCK>; ++q) {
        const uint8_t* quad_row = values + (b * kBlockQuads<BLOCK> + q) * kQuadRowBytes + 4 * kLanes * g;
        typename Quads::Weights w[G];
        for (int v = 0; v < G; ++v) w[v] = Quads::load(quad_row + 4 * kLanes * v);
        if (prefetch.ahead) {
          for (int v = 0; v < G; ++v) prefetch_panel_ahead(quad_row + 4 * kLanes * v);
        }
        for (owed += prefetch.next_lines; owed >= steps; owed -= steps) {
          prefetch_later_panel(prefetch.next + 64 * next_line++);
        }
        for (int m = 0; m < MR; ++m) {
          const I8Input input = i8_input(x + m * x_stride + (b * kBlockQuads<BLOCK> + q) * kInputQuadBytes);
          for (int v = 0; v < G; ++v) i8_dot(block_acc[m][v], w[v], input);
        }
      }
      for (int v = 0; v < G; ++v) {
        const Vec16 w_scale = vload_f16(scales + b * kInt8PanelColumns + kLanes * (g + v));
        for (int m = 0; m < MR; ++m) {
          const Vec16 block_scale = vmul(w_scale, vset1(x_scales[m * blocks + b]));
          if constexpr (kSumsInMemory) {
            float* sum = memory_sums[m] + kLanes * (g + v);
            vstore(sum, vfma(i8_finish(block_acc[m][v]), block_scale, vload(sum)));
          } else {
            acc[m][g + v] = vfma(i8_finish(block_acc[m][v]), block_scale, acc[m][g + v]);
          }
        }
      }
    }
  }
  if constexpr (kSumsInMemory) {
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < NV; ++v) acc[m][v] = vload(memory_sums[m] + kLanes * v);
    }
  }
  store_tile(acc, bias, out, out_stride, columns);
}

// A call's rows over one panel in balanced tiles of kTileRows rows, each over the panel's
// column tiles. The first row tile reads the panel from memory, prefetching it ahead where
// read_ahead says so. A run of one row tile leaves the next panel alone. In a run of more, the
// next panel (next_values; nullptr: none) goes into L2 in equal shares of its lines, one to
// each tile (the first row tile's too), each spread over the tile's reading; once the run
// before has brought this panel in, every tile reads it from cache. Before (to 2026-12-07),
// each tile after the first prefetched the whole next panel, so with 2-3 spanning tiles
// (5-10 rows) memory worked while the later tiles ran and idled through the first's compute.
// Zen 4, thirtieth session, both ways alternated in one process (medians of paired ratios):
// SmolLM2's int8 decode steps at 6 / 8 / 10 running took 0.91x / 0.94x / 0.90x the time, at
// 16 / 32 / 64 / 128 / 256 (the tier's tiles) 1.00x / 0.95x / 0.96x / 1.00x / 1.02x; the AVX2
// kernel there (spanning tiles of 2 rows) 0.95-0.97x at 4, 0.85-0.93x at 8 and 0.84-0.91x at
// 16. The sixth and eighth sessions had tried shares with 2- and 3-row spanning tiles and
// found 8-16 rows slower or unchanged (docs/design/experiments.md); why it differs now is not
// measured. Where the thread's share of the call ends, next_values is nullptr: what follows
// in memory is another thread's first panel or another tensor, and prefetching it took
// bandwidth from the call (with the shares, dropping it made 6-8 running 0.95-0.99x the time).
template <int kTileRows, int BLOCK, class Quads, class T>
void int8_row_tiles_of(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets,
                       int64_t rows, int64_t blocks, const uint8_t* values, const uint16_t* scales, const T* bias, T* out,
                       int64_t out_stride, int64_t columns, bool read_ahead, const uint8_t* next_values) {
  int64_t row_tiles = 0, tiles = 0;  // tiles: the row tiles' column tiles, all told
  for_balanced_row_tiles<kTileRows>(rows, [&](auto tile, int64_t) {
    constexpr int64_t kColumns = i8_tile_vectors<decltype(tile)::size>() * kLanes;
    ++row_tiles;
    tiles += (columns + kColumns - 1) / kColumns;
  });
  const int64_t panel_lines = blocks * kBlockQuads<BLOCK> * kQuadRowBytes / 64;
  const int64_t share = row_tiles > 1 && next_values != nullptr ? (panel_lines + tiles - 1) / tiles : 0;
  int64_t shared = 0;  // lines of the next panel handed out so far
  for_balanced_row_tiles<kTileRows>(rows, [&](auto tile, int64_t r) {
    constexpr int MR = decltype(tile)::size;
    for_column_tiles<i8_tile_vectors<MR>() * kLanes>(columns, [&](int64_t c0, int64_t width) {
      I8TilePrefetch prefetch{r == 0 && read_ahead};
      if (share > 0) {
        prefetch.next = next_values + 64 * shared;
        prefetch.next_lines = share < panel_lines - shared ? share : panel_lines - shared;
        shared += prefetch.next_lines;
      }
      int8_tile<MR, BLOCK, Quads>(x + r * x_stride, x_stride, x_scales + r * blocks, x_offsets + r * blocks, blocks,
                                  values + 4 * c0, scales + c0, bias == nullptr ? nullptr : bias + c0,
                                  out + r * out_stride + c0, out_stride, width, prefetch);
    });
  });
}

// Up to kI8WholePanelRunRows rows (a call bound by reading the weights), tiles that span the
// panel, the first reading it in address order; more, the tier's tiles. Before, with 17-48
// rows the first row tile waited on DRAM while the others ran from cache with the memory
// idle: SmolLM2's 121 int8 projections from DRAM took 17.4-17.8 ms at 32 rows against 11.2
// with them in cache (Zen 4), hence the next panel's prefetches (int8_row_tiles_of).
// kPrefetchLoneTile false: a call whose rows one such tile holds reads the panel with the
// hardware prefetcher alone (Int8TypedKernels::panel_without_prefetch says where and why).
template <int BLOCK, class Quads, bool kPrefetchLoneTile, class T>
void int8_row_tiles(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets, int64_t rows,
                    int64_t blocks, const uint8_t* values, const uint16_t* scales, const T* bias, T* out,
                    int64_t out_stride, int64_t columns, const uint8_t* next_values) {
  if constexpr (kI8WholePanelRows > 0) {
    if (rows <= kI8WholePanelRunRows) {
      return int8_row_tiles_of<kI8WholePanelRows, BLOCK, Quads>(x, x_stride, x_scales, x_offsets, rows, blocks, values,
                                                                scales, bias, out, out_stride, columns,
                                                                kPrefetchLoneTile || rows > kI8WholePanelRows,
                                                                next_values);
    }
  }
  int8_row_tiles_of<kI8TileRows, BLOCK, Quads>(x, x_stride, x_scales, x_offsets, rows, blocks, values, scales, bias,
                                               out, out_stride, columns, true, next_values);
}

// No tier reads a copy of the panel now (AVX2's vpmaddwd kernel read one widened to int16
// until 2026-12-02): `scratch` goes unused.
template <class T, class Quads = I8StoredQuads, bool kPrefetchLoneTile = true>
void int8_panel(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets, int64_t rows,
                int64_t blocks, int64_t block_inputs, const uint8_t* values, const uint16_t* scales, const T* bias, T* out,
                int64_t out_stride, int64_t columns, [[maybe_unused]] void* scratch, const uint8_t* next_values) {
  with_block_inputs(block_inputs, [&](auto block) {
    int8_row_tiles<decltype(block)::size, Quads, kPrefetchLoneTile>(x, x_stride, x_scales, x_offsets, rows, blocks,
                                                                    values, scales, bias, out, out_stride, columns,
                                                                    next_values);
  });
}

// 16 inputs from x[i], zero past `n` (< 16 only at a row's ragged end).
template <class T>
inline Vec16 load_upto16(const T* x, int64_t n) {
  if (n >= kLanes) return vload(x);
  alignas(64) float tail[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tail[i] = load1(x[i]);
  return vload(tail);
}

inline Vec16 vabs(Vec16 v) { return vmax(v, vsub(vzero(), v)); }

// The 8-bit block rule of activations and KV cache rows alike: a block of largest magnitude
// amax is stored as round-half-even(x * inverse) (i8_store_rounded) and the scale.
struct Int8BlockScale {
  Vec16 inverse;  // 127 / amax, 0 for a zero block
  float scale;    // amax / 127
};
inline Int8BlockScale int8_block_scale(float amax) {
  return {vset1(amax > 0.0f ? 127.0f / amax : 0.0f), amax / 127.0f};
}

template <int BLOCK, class T>
void int8_quantize_row_in(const T* x, int64_t in_features, int8_t* values, float* scales) {
  constexpr int kChunks = BLOCK / kLanes;
  const int64_t blocks = (in_features + BLOCK - 1) / BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * BLOCK;
    Vec16 chunks[kChunks];
    Vec16 magnitude = vzero();
    for (int c = 0; c < kChunks; ++c) {
      const int64_t left = in_features - first - c * kLanes;
      chunks[c] = left > 0 ? load_upto16(x + first + c * kLanes, left) : vzero();
      magnitude = vmax(magnitude, vabs(chunks[c]));
    }
    const Int8BlockScale block = int8_block_scale(vreduce_max(magnitude));
    scales[b] = block.scale;
    for (int c = 0; c < kChunks; ++c) i8_store_rounded(values + first + c * kLanes, vmul(chunks[c], block.inverse));
  }
}

template <class T>
void int8_quantize_row(const T* x, int64_t in_features, int64_t block_inputs, int8_t* values, float* scales) {
  with_block_inputs(block_inputs, [&](auto block) {
    int8_quantize_row_in<decltype(block)::size>(x, in_features, values, scales);
  });
}

template <class T>
void int8_quantize_kv_row(const T* x, int64_t head_size, int8_t* row) {
  Vec16 magnitude = vzero();
  for (int64_t i = 0; i < head_size; i += kLanes) magnitude = vmax(magnitude, vabs(vload(x + i)));
  const Int8BlockScale block = int8_block_scale(vreduce_max(magnitude));
  for (int64_t i = 0; i < head_size; i += kLanes) i8_store_rounded(row + i, vmul(vload(x + i), block.inverse));
  std::memcpy(row + head_size, &block.scale, sizeof block.scale);
}

// Int8TypedKernels::narrow_panel: the section's own way where it has one.
#ifdef CONTBATCH_I8_NARROW_QUADS
template <class T>
constexpr Int8PanelFn<T> kI8NarrowPanel = &int8_panel<T, CONTBATCH_I8_NARROW_QUADS>;
#else
template <class T>
constexpr Int8PanelFn<T> kI8NarrowPanel = nullptr;
#endif

// Int8TypedKernels::panel_without_prefetch: where the section's kI8LoneTileWithoutPrefetch
// asks for it (and it has tiles that span the panel).
template <class T>
constexpr Int8PanelFn<T> kI8PanelWithoutPrefetch =
    kI8LoneTileWithoutPrefetch && kI8WholePanelRows > 0 ? &int8_panel<T, I8StoredQuads, false> : nullptr;

constexpr Int8TypedKernels<float> kInt8Fp32{&int8_panel<float>, &int8_quantize_row<float>,
                                            &int8_quantize_kv_row<float>, kI8NarrowPanel<float>,
                                            kI8PanelWithoutPrefetch<float>};
constexpr Int8TypedKernels<uint16_t> kInt8Bf16{&int8_panel<uint16_t>, &int8_quantize_row<uint16_t>,
                                               &int8_quantize_kv_row<uint16_t>, kI8NarrowPanel<uint16_t>,
                                               kI8PanelWithoutPrefetch<uint16_t>};
constexpr Int8Kernels kTierTable{CONTBATCH_TIER_NAME, kI8TileRows, &kInt8Fp32,
                                 &kInt8Bf16,          &int8_scratch_bytes, kVectorRunRows};
