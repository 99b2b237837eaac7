// The bf16 linear kernel on AMX tiles (Sapphire Rapids and later Xeons), over the same
// panel-packed weights as the vector kernels (linear_kernel_api.h). A panel's pair row
// (64 columns x 2 inputs, 256 bytes) is, 64 bytes at a time, one row of the B operand
// tdpbf16ps takes (16 columns x an input pair), so 16 pair rows read with a 256-byte stride
// are a B tile of 16 columns x 32 inputs: the panels feed the tiles as they are stored, and
// a weight is held once for both kernels (before, on AMX CPUs, a second copy in oneDNN's
// layout served calls of many rows).
//
// Tiles: 0-3 the fp32 sums, 4-5 the inputs (16 rows x 32 inputs each), 6-7 the weights.
// A call of up to 16 rows (a decode step, bound by reading the weights) sums 16 rows x all
// 64 columns at once, so the panel is read once in address order; more rows run in blocks
// of 32 rows x 32 columns (2 input tiles against 2 weight tiles: each tile loaded feeds two
// tdpbf16ps), in passes of at most 512 inputs whose weight tiles stay in L1 across the
// call's blocks, while the next panel is prefetched into L2 (sum_row_blocks). A last block
// of fewer rows runs from a zero-padded copy, as 16 rows where it has no more.
// Sums are fp32 (tdpbf16ps: exact products, sums rounded to nearest even, denormals
// flushed), the bias is added in fp32 and the result rounded to bf16 once.
//
// Included after simd_avx512.h inside the AMX TU's target region (linear_amx.cpp).
#pragma once

#include "amx_tiles.h"

constexpr int64_t kAmxInputs = 32;     // inputs a tile multiplies at once (16 pair rows)
constexpr int64_t kAmxBlockRows = 32;  // rows of the larger blocks: the driver's unit

// Scratch: the header (AmxPaddedRows), the fp32 sums of a call, and a block's rows copied
// and zero-padded to 32 when it has fewer.
// Rows a call at most: 8 blocks of 32, each reading a pass's weight tiles from L1.
constexpr int64_t kAmxRunRows = 8 * kAmxBlockRows;
constexpr int64_t kAmxSumsBytes = kAmxRunRows * kPanelColumns * 4;
inline int64_t amx_scratch_bytes(int64_t in_features) {
  return kLinearScratchHeader + kAmxSumsBytes + kAmxBlockRows * in_features * 2;
}

// A block of `rows` (< 32) rows from x, zero-padded to 32 rows of in_features.
inline const uint16_t* padded_block(void* scratch, const uint16_t* x, int64_t x_stride, int64_t rows,
                                    int64_t in_features) {
  char* padded = static_cast<char*>(scratch) + kLinearScratchHeader + kAmxSumsBytes;
  return reinterpret_cast<const uint16_t*>(padded_rows(static_cast<AmxPaddedRows*>(scratch), padded, x, x_stride * 2,
                                                       rows, in_features * 2, kAmxBlockRows));
}

// sums[16][64] (row stride 64 floats) for 16 rows of inputs at x against all 64 columns.
inline void sum_rows16(const uint16_t* x, int64_t x_stride, int64_t in_features, const uint16_t* panel, float* sums) {
  zero_sum_tiles();
  const char* weights = reinterpret_cast<const char*>(panel);
  for (int64_t k = 0; k < in_features; k += kAmxInputs, weights += kAmxInputs / 2 * kAmxPanelRowBytes) {
    amx_rows16_step<false>(x + k, x_stride * 2, weights);
  }
  store_sum_tiles(sums);
}

// Inputs of one pass over a block of rows: a weight tile pair (32 columns) of that many
// inputs, 64 bytes an input, stays in L1 (48 KiB on Sapphire Rapids) while every block of
// 32 rows of the call runs against it.
constexpr int64_t kAmxPassInputs = 512;
inline int64_t inputs_per_pass(int64_t in_features) {
  const int64_t chunks = in_features / kAmxInputs;
  const int64_t passes = (in_features + kAmxPassInputs - 1) / kAmxPassInputs;
  return (chunks + passes - 1) / passes * kAmxInputs;
}

// sums[rows][64] (rows a multiple of 32) for the inputs at x against the panel's columns:
// per pass over inputs [k0, k1) and half of 32 columns, each 32-row block's 2 x 2 sum tiles
// start from zero (the first pass) or the sums so far, and are stored back.
inline void sum_row_blocks(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features,
                           const uint16_t* panel, int64_t columns, float* sums) {
  constexpr int64_t kSumStride = kPanelColumns * 4;
  const int64_t pass_inputs = inputs_per_pass(in_features);
  // The panel after this one (the thread's next call, most often) goes into L2 while this
  // one is multiplied: its lines spread evenly over this call's tile steps.
  const char* next_panel = reinterpret_cast<const char*>(panel) + in_features / 2 * kAmxPanelRowBytes;
  const int64_t next_lines = in_features / 2 * kAmxPanelRowBytes / 64;
  const int64_t steps = rows / kAmxBlockRows * (columns > 32 ? 2 : 1) * (in_features / kAmxInputs);
  if (steps == 0) return;
  const int64_t lines_per_step = (next_lines + steps - 1) / steps;
  int64_t next_line = 0;
  for (int64_t k0 = 0; k0 < in_features; k0 += pass_inputs) {
    const int64_t k1 = k0 + pass_inputs < in_features ? k0 + pass_inputs : in_features;
    for (int64_t half = 0; half * 32 < columns; ++half) {
      const char* pass_weights = reinterpret_cast<const char*>(panel) + k0 / 2 * kAmxPanelRowBytes + half * 128;
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxBlockRows) {
        float* block_sums = sums + r0 * kPanelColumns + half * 32;
        float* lower_sums = block_sums + kAmxTileRows * kPanelColumns;
        if (k0 == 0) {
          zero_sum_tiles();
        } else {
          _tile_loadd(0, block_sums, kSumStride);
          _tile_loadd(1, block_sums + 16, kSumStride);
          _tile_loadd(2, lower_sums, kSumStride);
          _tile_loadd(3, lower_sums + 16, kSumStride);
        }
        const uint16_t* upper = x + r0 * x_stride;
        const uint16_t* lower = upper + kAmxTileRows * x_stride;
        const char* weights = pass_weights;
        for (int64_t k = k0; k < k1; k += kAmxInputs, weights += kAmxInputs / 2 * kAmxPanelRowBytes) {
          for (int64_t l = 0; l < lines_per_step && next_line < next_lines; ++l, ++next_line) {
            _mm_prefetch(next_panel + next_line * 64, _MM_HINT_T1);
          }
          _tile_loadd(4, upper + k, x_stride * 2);
          _tile_loadd(6, weights, kAmxPanelRowBytes);
          _tile_loadd(7, weights + 64, kAmxPanelRowBytes);
          _tile_loadd(5, lower + k, x_stride * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, block_sums, kSumStride);
        _tile_stored(1, block_sums + 16, kSumStride);
        _tile_stored(2, lower_sums, kSumStride);
        _tile_stored(3, lower_sums + 16, kSumStride);
      }
    }
  }
}

// The LinearKernels::bf16_panel of this kernel; in_features a multiple of kAmxInputs.
// Up to 16 rows: one pass of 16 x 64 sums. More: the whole 32-row blocks straight from x,
// then the rest (if any) from a zero-padded copy.
void amx_bf16_panel(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                    const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns, void* scratch) {
  configure_tiles();
  auto* sums = reinterpret_cast<float*>(static_cast<char*>(scratch) + kLinearScratchHeader);
  const int64_t whole_rows = rows / kAmxBlockRows * kAmxBlockRows, rest = rows - whole_rows;
  if (rows <= kAmxTileRows) {
    if (rows == kAmxTileRows) {
      sum_rows16(x, x_stride, in_features, panel, sums);
    } else {
      sum_rows16(padded_block(scratch, x, x_stride, rows, in_features), in_features, in_features, panel, sums);
    }
  } else {
    sum_row_blocks(x, x_stride, whole_rows, in_features, panel, columns, sums);
    if (rest > 0) {
      const uint16_t* padded = padded_block(scratch, x + whole_rows * x_stride, x_stride, rest, in_features);
      float* rest_sums = sums + whole_rows * kPanelColumns;
      if (rest <= kAmxTileRows) {
        sum_rows16(padded, in_features, in_features, panel, rest_sums);
      } else {
        sum_row_blocks(padded, in_features, kAmxBlockRows, in_features, panel, columns, rest_sums);
      }
    }
  }
  _tile_release();
  store_sum_rows(sums, rows, bias, out, out_stride, columns);
}

constexpr LinearKernels kTierTable{&amx_bf16_panel, kAmxBlockRows, &amx_scratch_bytes, kAmxRunRows};
