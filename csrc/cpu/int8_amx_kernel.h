// The int8 linear kernel on AMX tiles (Sapphire Rapids and later Xeons), over the int8
// panels the vector kernels read (int8_kernel_api.h), for weights in 64-input blocks. A
// panel's quad row (64 columns x 4 inputs, 256 bytes) is, 64 bytes at a time, one row of the
// B operand tdpbsud takes (16 columns x 4 unsigned bytes), and a 64-input block is 16 quad
// rows: one B tile per 16 columns and block, read with a 256-byte stride. The staged inputs
// (int8, 64 bytes a block) are the A tile's rows, as the driver staged them for the VNNI
// kernel.
//
// Per 16 rows and block: 4 tdpbsud give the block's int32 sums for all 64 columns (tiles
// 0-3; tile 4 the inputs, 5-7 the weights), stored to scratch, and each row's sums, plus its
// offset (-o x the block's input sum, which takes the weights' +o out), become fp32 and
// are added, times the row's and column's scales, to the row's fp32 sums; those are rounded
// to the output type once, after the bias. The int32 block sums are exact, as in the vector
// kernels; the fp32 sums run over blocks in the same order, so the result is the VNNI
// kernel's up to the rounding of fused multiply-adds.
//
// Included after simd_avx512.h inside the AMX TU's target region (int8_amx.cpp).
#pragma once

#include "amx_tiles.h"

constexpr int64_t kAmxBlockBytes = kInt8WideBlock / 4 * kAmxPanelRowBytes;  // a block of a panel: 16 quad rows
// Rows a call at most: the panel (from L2 after the first 16 rows) against 16 tiles of rows.
constexpr int64_t kAmxInt8RunRows = 16 * kAmxTileRows;

// Scratch after the header (AmxPaddedRows): the fp32 sums of a 16-row tile (16 x 64), the
// int32 sums of a block (16 x 64), and the last tile's rows zero-padded to 16 when it has fewer.
constexpr int64_t kAmxSumsBytes = kAmxTileRows * kInt8PanelColumns * 4;
inline int64_t amx_int8_scratch_bytes(int64_t padded_inputs) {
  return kInt8ScratchHeader + 2 * kAmxSumsBytes + kAmxTileRows * padded_inputs;
}

// sums[m][64] += (the block's int32 sums of row m + offsets[m]) x w_scales x x_scales[m].
inline void add_block(const int32_t* block_sums, const int32_t* offsets, const float* x_scales, int64_t blocks,
                      int64_t rows, const uint16_t* w_scales, float* sums) {
  for (int64_t v = 0; v < kInt8PanelColumns / kLanes; ++v) {
    const Vec16 w_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_scales + v * kLanes)));
    for (int64_t m = 0; m < rows; ++m) {
      const __m512i block = _mm512_add_epi32(_mm512_loadu_si512(block_sums + m * kInt8PanelColumns + v * kLanes),
                                             _mm512_set1_epi32(offsets[m * blocks]));
      float* row_sums = sums + m * kInt8PanelColumns + v * kLanes;
      vstore(row_sums, vfma(_mm512_cvtepi32_ps(block), vmul(w_scale, vset1(x_scales[m * blocks])), vload(row_sums)));
    }
  }
}

// out[rows (<= 16), columns] for 16 rows of staged inputs at x (x_stride bytes apart).
template <class T>
void amx_int8_rows16(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets, int64_t rows,
                     int64_t blocks, const uint8_t* values, const uint16_t* scales, const T* bias, T* out,
                     int64_t out_stride, int64_t columns, float* sums, int32_t* block_sums) {
  for (int64_t i = 0; i < rows * kInt8PanelColumns; i += kLanes) vstore(sums + i, vzero());
  const char* weights = reinterpret_cast<const char*>(values);
  for (int64_t b = 0; b < blocks; ++b, weights += kAmxBlockBytes) {
    zero_sum_tiles();
    amx_rows16_step<true>(x + b * kInt8WideBlock, x_stride, weights);
    store_sum_tiles(block_sums);
    add_block(block_sums, x_offsets + b, x_scales + b, blocks, rows, scales + b * kInt8PanelColumns, sums);
  }
  store_sum_rows(sums, rows, bias, out, out_stride, columns);
}

// The Int8TypedKernels::panel of this kernel; block_inputs must be kInt8WideBlock (the
// driver sends no other here).
template <class T>
void amx_int8_panel(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets, int64_t rows,
                    int64_t blocks, [[maybe_unused]] int64_t block_inputs, const uint8_t* values, const uint16_t* scales,
                    const T* bias, T* out, int64_t out_stride, int64_t columns, void* scratch,
                    [[maybe_unused]] const uint8_t* next_values) {
  configure_tiles();
  char* bytes = static_cast<char*>(scratch) + kInt8ScratchHeader;
  auto* sums = reinterpret_cast<float*>(bytes);
  auto* block_sums = reinterpret_cast<int32_t*>(bytes + kAmxSumsBytes);
  char* padded = bytes + 2 * kAmxSumsBytes;
  const int64_t row_inputs = blocks * kInt8WideBlock;
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxTileRows) {
    const int64_t n = rows - r0 < kAmxTileRows ? rows - r0 : kAmxTileRows;
    const int8_t* tile_x = x + r0 * x_stride;
    int64_t tile_stride = x_stride;
    if (n < kAmxTileRows) {
      tile_x = reinterpret_cast<const int8_t*>(padded_rows(static_cast<AmxPaddedRows*>(scratch), padded, tile_x,
                                                           x_stride, n, row_inputs, kAmxTileRows));
      tile_stride = row_inputs;
    }
    amx_int8_rows16(tile_x, tile_stride, x_scales + r0 * blocks, x_offsets + r0 * blocks, n, blocks, values, scales,
                    bias, out + r0 * out_stride, out_stride, columns, sums, block_sums);
  }
  _tile_release();
}

constexpr Int8TypedKernels<float> kAmxInt8Fp32{&amx_int8_panel<float>, nullptr, nullptr};
constexpr Int8TypedKernels<uint16_t> kAmxInt8Bf16{&amx_int8_panel<uint16_t>, nullptr, nullptr};
constexpr Int8Kernels kTierTable{"amx", kAmxTileRows, &kAmxInt8Fp32, &kAmxInt8Bf16, &amx_int8_scratch_bytes,
                                 kAmxInt8RunRows};
