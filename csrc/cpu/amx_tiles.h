// What the AMX kernels (linear_amx_kernel.h: bf16, int8_amx_kernel.h: int8) share: the tile
// shapes, and one step of 16 rows x a panel's 64 columns. Both read panels whose 256-byte rows
// hold 64 columns x (2 bf16 | 4 int8) inputs: 64 bytes of such a row are one row of a B tile.
// Included after simd_avx512.h inside an AMX TU's target region.
#pragma once

constexpr int64_t kAmxTileRows = 16;        // rows of any tile (palette 1)
constexpr int64_t kAmxPanelRowBytes = 256;  // a panel's pair row (bf16) or quad row (int8)

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
