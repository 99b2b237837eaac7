// The bf16 linear kernel on AMX tiles (linear_amx_kernel.h): Sapphire Rapids and later
// Xeons, called by linear.cpp for calls of many rows where cpu_isa.h's amx_linear_kernels()
// says AMX is on. GCC 11 is the first with AMX intrinsics.
#define CONTBATCH_AVX512_BF16 1
#define CONTBATCH_TIER_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16"
#define CONTBATCH_TIER_SIMD "simd_avx512.h"
#define CONTBATCH_TIER_NAME "amx"
#define CONTBATCH_TIER_GETTER amx_bf16_linear_kernels
#define CONTBATCH_TIER_BODY "linear_amx_kernel.h"
#define CONTBATCH_TIER_TABLE LinearKernels
#if defined(__GNUC__) && __GNUC__ < 11
#define CONTBATCH_TIER_UNAVAILABLE 1
#endif
#include "kernels_x86_tier.h"
