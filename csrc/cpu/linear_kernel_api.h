// Function table of the bf16 linear kernel (linear_kernel.h), one per ISA tier.
#pragma once

#include <cstdint>

namespace contbatch::cpu {

// Weights of a bf16 linear layer, [out_features, in_features], are stored as panels of 64
// output columns: packed[panel][pair][column][2] holds weight[64 * panel + column]
// [2 * pair + 0 / 1], zero-padded to whole panels and an even number of inputs. One pair
// row of a panel (64 columns x 2 inputs, 256 bytes) is what vdpbf16ps reads against one
// broadcast pair of inputs, so a panel streams from memory in address order.
constexpr int64_t kPanelColumns = 64;

// Scratch one bf16_panel call needs: a row tile's inputs, staged pair by pair (at most
// 8 rows of 8 bytes a pair), and for the widened kernel (tiers without bf16 dot products)
// the panel widened to fp32 (64 columns x 2 inputs x 4 bytes a pair).
constexpr int64_t kMaxLinearTileRows = 8;
// The first 64 bytes hold which panel the widened copy is of: the driver zeroes them before
// a thread's first task of each call, so consecutive tasks on one panel widen it once.
constexpr int64_t kLinearScratchHeader = 64;
inline int64_t linear_scratch_bytes(int64_t in_features) {
  return kLinearScratchHeader + (in_features + 1) / 2 * kMaxLinearTileRows * 8;
}
inline int64_t widened_linear_scratch_bytes(int64_t in_features) {
  return linear_scratch_bytes(in_features) + (in_features + 1) / 2 * kPanelColumns * 2 * 4;
}

// Rows one call of the vector kernels takes at most: a panel's weights (64 columns x
// in_features) stay in L2 across a thread's consecutive calls on it (panel_runs.h).
constexpr int64_t kVectorRunRows = 48;

struct LinearKernels {
  // out[rows, columns] = x[rows, in_features] . panel (+ bias[columns]) for one panel;
  // columns <= 64, bias may be nullptr. Rows are processed in register tiles; `scratch`
  // holds scratch_bytes(in_features), 64-byte aligned, private to the calling thread,
  // its header zeroed by the driver before the thread's first task of the call.
  void (*bf16_panel)(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                     const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns, void* scratch);
  int64_t tile_rows;  // rows of its register tile: the driver's unit of work (panel_runs.h)
  int64_t (*scratch_bytes)(int64_t in_features);  // what `scratch` must hold
  int64_t run_rows;  // rows of one call at most (a multiple of tile_rows)
};

}  // namespace contbatch::cpu
