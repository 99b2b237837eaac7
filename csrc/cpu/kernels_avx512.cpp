// The CPU kernels for AVX-512 F/BW/VL/DQ without AVX512_BF16 (Skylake-SP to Ice Lake
// Xeons): 16-lane fp32 arithmetic, bf16 converted to fp32 by a shift.
#define CONTBATCH_TIER_TARGET "avx512f,avx512bw,avx512vl,avx512dq,fma"
#define CONTBATCH_TIER_SIMD "simd_avx512.h"
#define CONTBATCH_TIER_NAME "avx512"
#define CONTBATCH_TIER_GETTER avx512_kernel_set
#include "kernels_x86_tier.h"
