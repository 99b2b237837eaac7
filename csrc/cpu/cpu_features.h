// Runtime CPU feature check shared by the kernel drivers (attention.cpp, layers.cpp).
#pragma once

namespace contbatch::cpu {

// AVX-512 with AVX512_BF16: what kernels_avx512.cpp is compiled for.
inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace contbatch::cpu
