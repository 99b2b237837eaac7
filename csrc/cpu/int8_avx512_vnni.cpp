// The int8 linear kernel for AVX-512 with VNNI (vpdpbusd): Cascade Lake, Ice Lake and later
// Xeons, Zen 4. Serves both AVX-512 tiers on CPUs that have VNNI.
#define CONTBATCH_TIER_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma"
#define CONTBATCH_TIER_SIMD "simd_avx512.h"
#define CONTBATCH_TIER_INT8 "simd_int8_vnni.h"
#define CONTBATCH_TIER_NAME "avx512_vnni"
#define CONTBATCH_TIER_GETTER int8_avx512_vnni_kernels
#define CONTBATCH_TIER_BODY "int8_tier.h"
#define CONTBATCH_TIER_TABLE Int8Kernels
#include "kernels_x86_tier.h"
