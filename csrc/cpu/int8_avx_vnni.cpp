// The int8 linear kernel for AVX2 CPUs with AVX-VNNI (256-bit vpdpbusd): Intel Alder Lake
// and later client CPUs. GCC learned the avxvnni target in version 11; older compilers build
// without this kernel (its getter returns nullptr) and those CPUs run AVX2's.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 11
#define CONTBATCH_TIER_UNAVAILABLE 1
#endif
#define CONTBATCH_TIER_TARGET "avx2,fma,f16c,avxvnni"
#define CONTBATCH_TIER_SIMD "simd_avx2.h"
#define CONTBATCH_TIER_INT8 "simd_int8_avx_vnni.h"
#define CONTBATCH_TIER_NAME "avx_vnni"
#define CONTBATCH_TIER_GETTER int8_avx_vnni_kernels
#define CONTBATCH_TIER_BODY "int8_tier.h"
#define CONTBATCH_TIER_TABLE Int8Kernels
#include "kernels_x86_tier.h"
