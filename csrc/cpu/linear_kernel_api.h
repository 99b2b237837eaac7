// Function table of the bf16 linear kernel (linear_kernel.h), one per ISA build.
#pragma once

#include <cstdint>

namespace contbatch::cpu {

// Weights of a bf16 linear layer, [out_features, in_features], are stored as panels of 64
// output columns: packed[panel][pair][column][2] holds weight[64 * panel + column]
// [2 * pair + 0 / 1], zero-padded to whole panels and an even number of inputs. One pair
// row of a panel (64 columns x 2 inputs, 256 bytes) is what vdpbf16ps reads against one
// broadcast pair of inputs, so a panel streams from memory in address order.
constexpr int64_t kPanelColumns = 64;

struct LinearKernels {
  // out[rows, columns] = x[rows, in_features] . panel (+ bias[columns]) for one panel;
  // columns <= 64, bias may be nullptr. Rows are processed in register tiles.
  void (*bf16_panel)(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* panel,
                     const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t columns);
};

LinearKernels generic_linear_kernels();
// nullptr where the build has no AVX-512 code (non-GCC or non-x86-64).
const LinearKernels* avx512_linear_kernels();

}  // namespace contbatch::cpu
