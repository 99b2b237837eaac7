// Function table of the row kernels (layers_kernel.h), one per ISA build.
#pragma once

#include <cstdint>

namespace contbatch::cpu {

// Tokens per block of the sampler's weights: a draw finds its block from the block sums, then
// its token within the block (contbatch/ops/reference.py DRAW_BLOCK).
constexpr int64_t kSampleBlock = 256;

template <class T>
struct LayerKernels {
  void (*rms_norm)(T* out, const T* x, const T* weight, int64_t n, float eps);
  void (*add_rms_norm)(T* x, T* residual, const T* weight, int64_t n, float eps);
  void (*silu_and_mul)(T* out, const T* gate_up, int64_t d);
  void (*rotary)(T* x, const T* cos, const T* sin, int64_t half);
  int64_t (*argmax)(const T* x, int64_t n);
  // The sampler's two passes over a row (layers_kernel.h): its largest value, and its weights.
  float (*row_max)(const T* x, int64_t n);
  void (*tempered_weights)(const T* x, int64_t n, float top, float scale, float floor, float* weights,
                           float* block_sums);
};

struct LayerKernelSet {
  const LayerKernels<float>* fp32;
  const LayerKernels<uint16_t>* bf16;
  // Index of the first of x[begin, n) above `bound`, n if none: how the sampler finds the few
  // weights that can enter its candidates without looking at the others one by one.
  int64_t (*first_above)(const float* x, int64_t begin, int64_t n, float bound);
};

}  // namespace contbatch::cpu
