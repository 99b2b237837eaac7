// The CPU kernels for AVX2 + FMA + F16C: laptops and desktops, Zen 2/3 EPYC, Haswell to
// Broadwell Xeons. bf16 is stored as bf16 and computed in fp32.
#define CONTBATCH_TIER_TARGET "avx2,fma,f16c"
#define CONTBATCH_TIER_SIMD "simd_avx2.h"
#define CONTBATCH_TIER_NAME "avx2"
#define CONTBATCH_TIER_GETTER avx2_kernel_set
#include "kernels_x86_tier.h"
