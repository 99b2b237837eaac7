// One x86 ISA tier of the CPU kernels, compiled through a function-level target pragma so
// that the rest of the extension keeps the baseline ISA and one build runs on any x86-64
// CPU; cpu_isa.cpp calls a tier only on a CPU that has its ISA. Included by one
// kernels_<tier>.cpp, which defines first:
//   CONTBATCH_TIER_TARGET  the GCC target string ("avx2,fma,f16c")
//   CONTBATCH_TIER_SIMD    the tier's simd header ("simd_avx2.h")
//   CONTBATCH_TIER_NAME    the tier's name as CONTBATCH_CPU_ISA spells it ("avx2")
//   CONTBATCH_TIER_GETTER  the kernel_set.h getter it defines (avx2_kernel_set)
// and, for a table other than the tier's KernelSet (the int8 kernels, int8_<tier>.cpp):
//   CONTBATCH_TIER_BODY    the header that instantiates it ("int8_tier.h"; default "kernel_tier.h")
//   CONTBATCH_TIER_TABLE   its type (Int8Kernels; default KernelSet), named kTierTable by the body
// Everything compiled for the tier has internal linkage, so no tier's code can stand in
// for an inline function that other translation units share. Only GCC on x86-64 builds
// the tiers; elsewhere (or where the TU defines CONTBATCH_TIER_UNAVAILABLE: a compiler too old
// for its target) the getter returns nullptr and the generic kernels run.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "int8_kernel_api.h"
#include "kernel_set.h"

#ifndef CONTBATCH_TIER_BODY
#define CONTBATCH_TIER_BODY "kernel_tier.h"
#define CONTBATCH_TIER_TABLE KernelSet
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CONTBATCH_TIER_UNAVAILABLE)

#define CONTBATCH_PRAGMA(x) _Pragma(#x)
#define CONTBATCH_TARGET(isa) CONTBATCH_PRAGMA(GCC target(isa))

#pragma GCC push_options
CONTBATCH_TARGET(CONTBATCH_TIER_TARGET)
// GCC 12 flags the intrinsics' own _mm*_undefined_* temporaries as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace contbatch::cpu {
namespace {
#include CONTBATCH_TIER_SIMD
#include CONTBATCH_TIER_BODY
}  // namespace
}  // namespace contbatch::cpu
#pragma GCC pop_options

namespace contbatch::cpu {
const CONTBATCH_TIER_TABLE* CONTBATCH_TIER_GETTER() { return &kTierTable; }
}  // namespace contbatch::cpu

#else

namespace contbatch::cpu {
const CONTBATCH_TIER_TABLE* CONTBATCH_TIER_GETTER() { return nullptr; }
}  // namespace contbatch::cpu

#endif
