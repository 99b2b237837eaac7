// What the AMX kernels (linear_amx_kernel.h: bf16, int8_amx_kernel.h: int8) share: the tile
// shapes, and one step of 16 rows x a panel's 64 columns. Both read panels whose 256-byte rows
// hold 64 columns x (2 bf16 | 4 int8) inputs: 64 bytes of such a row are one row of a B tile.
// Included after simd_avx512.h inside an AMX TU's target region.
#pragma once

#include "layers_kernel.h"

constexpr int64_t kAmxTileRows = 16;        // rows of any tile (palette 1)
constexpr int64_t kAmxPanelColumns = 64;    // columns of a bf16 or int8 panel
constexpr int64_t kAmxPanelRowBytes = kAmxPanelColumns * 4;  // a panel's pair row (bf16) or quad row (int8)

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {  // tiles 0-7 all 16 rows x 64 bytes
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kAmxTileRows;
  }
  _tile_loadconfig(&config);
}

// Tile numbers are immediates in the instructions, so the dot product is picked here.
#define CONTBATCH_AMX_DOT(kInt8, sums, inputs, weights) \
  do {                                                  \
    if constexpr (kInt8) {                              \
      _tile_dpbsud(sums, inputs, weights);              \
    } else {                                            \
      _tile_dpbf16ps(sums, inputs, weights);            \
    }                                                   \
  } while (0)

// Sum tiles 0-3 (16 rows x columns 0-15, ..., 48-63) += the 16 input rows at `inputs`
// (input_stride bytes apart; tile 4) x the panel's 16 rows at `weights` (tiles 5-7, the
// fourth reusing the first's): tdpbsud (kInt8: signed inputs, unsigned weights) or tdpbf16ps.
template <bool kInt8>
inline void amx_rows16_step(const void* inputs, int64_t input_stride, const char* weights) {
  _tile_loadd(4, inputs, input_stride);
  _tile_loadd(6, weights, kAmxPanelRowBytes);
  _tile_loadd(7, weights + 64, kAmxPanelRowBytes);
  CONTBATCH_AMX_DOT(kInt8, 0, 4, 6);
  _tile_loadd(5, weights + 128, kAmxPanelRowBytes);
  CONTBATCH_AMX_DOT(kInt8, 1, 4, 7);
  _tile_loadd(6, weights + 192, kAmxPanelRowBytes);
  CONTBATCH_AMX_DOT(kInt8, 2, 4, 5);
  CONTBATCH_AMX_DOT(kInt8, 3, 4, 6);
}

inline void zero_sum_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The 4 sum tiles to sums[16][64] (4-byte sums, row stride 256 bytes).
inline void store_sum_tiles(void* sums) {
  char* bytes = static_cast<char*>(sums);
  _tile_stored(0, bytes, 256);
  _tile_stored(1, bytes + 64, 256);
  _tile_stored(2, bytes + 128, 256);
  _tile_stored(3, bytes + 192, 256);
}

// Scratch header of an AMX kernel: which rows `padded` holds. The driver zeroes it before a
// thread's first call of an op, so the rows copied for one panel serve the thread's next.
struct AmxPaddedRows {
  const void* from;
  int64_t rows;
};

// `rows` (< to_rows) rows of row_bytes at x (x_stride bytes apart) copied to `padded` and
// zero-padded to to_rows rows (a tile load reads 16 rows: never past the inputs), unless
// `header` says they are there already.
inline const char* padded_rows(AmxPaddedRows* header, char* padded, const void* x, int64_t x_stride, int64_t rows,
                               int64_t row_bytes, int64_t to_rows) {
  if (header->from != x || header->rows != rows) {
    const char* source = static_cast<const char*>(x);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(padded + r * row_bytes, source + r * x_stride, row_bytes);
    std::memset(padded + rows * row_bytes, 0, (to_rows - rows) * row_bytes);
    header->from = x;
    header->rows = rows;
  }
  return padded;
}

// out[rows, columns] = T(sums + bias), sums' rows a panel's columns apart; rounded
// as the vector kernels round (to nearest even).
template <class T>
inline void store_sum_rows(const float* sums, int64_t rows, const T* bias, T* out, int64_t out_stride,
                           int64_t columns) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* row_sums = sums + m * kAmxPanelColumns;
    T* row_out = out + m * out_stride;
    if (columns == kAmxPanelColumns) {
      for (int64_t c = 0; c < kAmxPanelColumns; c += kLanes) {
        vstore(row_out + c, bias == nullptr ? vload(row_sums + c) : vadd(vload(row_sums + c), vload(bias + c)));
      }
    } else {  // a partial last panel
      for (int64_t c = 0; c < columns; ++c) store1(row_out + c, row_sums[c] + (bias == nullptr ? 0.0f : load1(bias[c])));
    }
  }
}
