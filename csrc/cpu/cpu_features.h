// Runtime CPU feature check and kernel-build choice shared by the CPU op drivers.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

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

// Whether the ops run the AVX-512 kernels (`built`: this build compiled them) or the
// generic ones. CONTBATCH_CPU_ISA unset or "auto" picks AVX-512 where the CPU has it;
// "generic" or "avx512" force one. Read on every call, so tests can compare both builds
// in one process.
inline bool use_avx512_kernels(bool built) {
  static const bool has_avx512 = cpu_has_avx512_bf16();
  const char* env = std::getenv("CONTBATCH_CPU_ISA");
  const std::string_view isa = env == nullptr ? "auto" : env;
  if (isa == "generic") return false;
  if (isa == "avx512") {
    TORCH_CHECK_VALUE(has_avx512 && built,
                      "CONTBATCH_CPU_ISA=avx512, but this CPU or build lacks AVX-512 with AVX512_BF16");
    return true;
  }
  TORCH_CHECK_VALUE(isa == "auto" || isa.empty(), "CONTBATCH_CPU_ISA must be auto, generic or avx512, got '", isa,
                    "'");
  return has_avx512 && built;
}

}  // namespace contbatch::cpu
