// The int8 linear kernel in portable C++, for CPUs without AVX2 (or CONTBATCH_CPU_ISA=generic).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "int8_kernel_api.h"
#include "kernel_set.h"

#define CONTBATCH_TIER_NAME "generic"
#define CONTBATCH_TIER_INT8 "simd_int8_generic.h"

namespace contbatch::cpu {
namespace {
#include "simd_generic.h"
#include "int8_tier.h"
}  // namespace

const Int8Kernels* int8_generic_kernels() { return &kTierTable; }
}  // namespace contbatch::cpu
