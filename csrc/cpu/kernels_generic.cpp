// The CPU kernels for any CPU: portable C++ the compiler vectorises for the baseline ISA.
// Used where the CPU has no AVX2 (or the build no x86 tiers), or with CONTBATCH_CPU_ISA=generic.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_set.h"

#define CONTBATCH_TIER_NAME "generic"

namespace contbatch::cpu {
namespace {
#include "simd_generic.h"
#include "kernel_tier.h"
}  // namespace

const KernelSet* generic_kernel_set() { return &kTierTable; }
}  // namespace contbatch::cpu
