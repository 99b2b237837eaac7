// The CPU kernels for AVX-512 with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and
// later): bf16 pair dot products by vdpbf16ps in attention and the linear kernel.
#define CONTBATCH_AVX512_BF16 1
#define CONTBATCH_TIER_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"
#define CONTBATCH_TIER_SIMD "simd_avx512.h"
#define CONTBATCH_TIER_NAME "avx512_bf16"
#define CONTBATCH_TIER_GETTER avx512_bf16_kernel_set
#include "kernels_x86_tier.h"
