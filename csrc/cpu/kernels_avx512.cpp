// The CPU kernels (attention_kernel.h, layers_kernel.h, linear_kernel.h) compiled for AVX-512
// (avx512f/bw/vl/dq + avx512_bf16) through a function-level target pragma: the rest of the
// extension keeps the baseline ISA, and the drivers call these functions only after a
// runtime CPU check (cpu_features.h). Everything here has internal linkage, so no AVX-512
// code can stand in for an inline function that other translation units share. Only GCC
// on x86-64 builds it; elsewhere the getters return nullptr and the generic kernels run.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_kernel_api.h"
#include "layers_kernel_api.h"
#include "linear_kernel_api.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// GCC 12 flags the intrinsics' own _mm512_undefined_* temporaries as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace contbatch::cpu {
namespace {
#include "simd_avx512.h"
#include "attention_kernel.h"
#include "layers_kernel.h"
#include "linear_kernel.h"
}  // namespace
}  // namespace contbatch::cpu
#pragma GCC pop_options

namespace contbatch::cpu {
const AttentionKernels* avx512_kernels() { return &kKernels; }
const LayerKernelSet* avx512_layer_kernels() {
  static const LayerKernelSet set{layer_kernels_for<float>(), layer_kernels_for<uint16_t>()};
  return &set;
}
const LinearKernels* avx512_linear_kernels() {
  static const LinearKernels kernels{&linear_bf16_panel};
  return &kernels;
}
}  // namespace contbatch::cpu

#else

namespace contbatch::cpu {
const AttentionKernels* avx512_kernels() { return nullptr; }
const LayerKernelSet* avx512_layer_kernels() { return nullptr; }
const LinearKernels* avx512_linear_kernels() { return nullptr; }
}  // namespace contbatch::cpu

#endif
