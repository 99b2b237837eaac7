// The attention kernel compiled for AVX-512 (avx512f/bw/vl/dq + avx512_bf16) through a
// function-level target pragma: the rest of the extension keeps the baseline ISA, and the
// driver calls these functions only after a runtime CPU check (attention.cpp). Everything
// here has internal linkage, so no AVX-512 code can stand in for an inline function that
// other translation units share. Only GCC on x86-64 builds it; elsewhere avx512_kernels()
// returns nullptr and the generic kernel runs.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_kernel_api.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// GCC 12 flags the intrinsics' own _mm512_undefined_* temporaries as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace contbatch::cpu {
namespace {
#include "simd_avx512.h"
#include "attention_kernel.h"
}  // namespace
}  // namespace contbatch::cpu
#pragma GCC pop_options

namespace contbatch::cpu {
const AttentionKernels* avx512_kernels() { return &kKernels; }
}  // namespace contbatch::cpu

#else

namespace contbatch::cpu {
const AttentionKernels* avx512_kernels() { return nullptr; }
}  // namespace contbatch::cpu

#endif
