// The int8 linear kernel for AVX2 + FMA + F16C (vpmaddubsw, simd_int8_avx2.h): AVX2 CPUs,
// and AVX-512 CPUs without VNNI.
#define CONTBATCH_TIER_TARGET "avx2,fma,f16c"
#define CONTBATCH_TIER_SIMD "simd_avx2.h"
#define CONTBATCH_TIER_INT8 "simd_int8_avx2.h"
#define CONTBATCH_TIER_NAME "avx2"
#define CONTBATCH_TIER_GETTER int8_avx2_kernels
#define CONTBATCH_TIER_BODY "int8_tier.h"
#define CONTBATCH_TIER_TABLE Int8Kernels
#include "kernels_x86_tier.h"
