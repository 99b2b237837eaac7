// The CPU kernels for any CPU: portable C++ the compiler vectorises for the baseline ISA.
// Used when the CPU lacks AVX-512/AVX512_BF16, or with CONTBATCH_CPU_ISA=generic.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_kernel_api.h"
#include "layers_kernel_api.h"
#include "linear_kernel_api.h"

namespace contbatch::cpu {
namespace {
#include "simd_generic.h"
#include "attention_kernel.h"
#include "layers_kernel.h"
#include "linear_kernel.h"
}  // namespace

const AttentionKernels* generic_kernels() { return &kKernels; }
LayerKernelSet generic_layer_kernels() { return {layer_kernels_for<float>(), layer_kernels_for<uint16_t>()}; }
LinearKernels generic_linear_kernels() { return {&linear_bf16_panel}; }
}  // namespace contbatch::cpu
