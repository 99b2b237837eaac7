// Function table of the row kernels (layers_kernel.h), one per ISA build.
#pragma once

#include <cstdint>

namespace contbatch::cpu {

template <class T>
struct LayerKernels {
  void (*rms_norm)(T* out, const T* x, const T* weight, int64_t n, float eps);
  void (*add_rms_norm)(T* x, T* residual, const T* weight, int64_t n, float eps);
  void (*silu_and_mul)(T* out, const T* gate_up, int64_t d);
  void (*rotary)(T* x, const T* cos, const T* sin, int64_t half);
  int64_t (*argmax)(const T* x, int64_t n);
};

struct LayerKernelSet {
  const LayerKernels<float>* fp32;
  const LayerKernels<uint16_t>* bf16;
};

}  // namespace contbatch::cpu
