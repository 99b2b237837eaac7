// Run-time choice of the CPU kernels' ISA tier (cpu_isa.h).
#include "cpu_isa.h"

#include "../ops.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>

namespace contbatch::cpu {
namespace {

struct Tier {
  const char* name;
  const KernelSet* (*kernels)();  // returns nullptr where this build did not compile the tier
  bool (*cpu_has)();
};

#if defined(__x86_64__) && defined(__GNUC__)
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
bool has_avx512_bf16() { return false; }
#endif
bool any_cpu() { return true; }

// Slowest first.
constexpr Tier kTiers[] = {
    {"generic", &generic_kernel_set, &any_cpu},
    {"avx2", &avx2_kernel_set, &has_avx2},
    {"avx512", &avx512_kernel_set, &has_avx512},
    {"avx512_bf16", &avx512_bf16_kernel_set, &has_avx512_bf16},
};

const KernelSet* runnable(const Tier& tier) { return tier.cpu_has() ? tier.kernels() : nullptr; }

const KernelSet* best_kernels() {
  const KernelSet* best = nullptr;
  for (const Tier& tier : kTiers) {
    if (const KernelSet* set = runnable(tier)) best = set;
  }
  return best;
}

std::atomic<const KernelSet*>& chosen() {
  static std::atomic<const KernelSet*> kernels{best_kernels()};
  return kernels;
}

}  // namespace

const KernelSet& active_kernels() { return *chosen().load(std::memory_order_relaxed); }

void set_cpu_isa(std::string_view name) {
  if (name == "auto" || name.empty()) {
    chosen().store(best_kernels());
    return;
  }
  for (const Tier& tier : kTiers) {
    if (name != tier.name) continue;
    TORCH_CHECK_VALUE(tier.cpu_has() && tier.kernels() != nullptr, "CONTBATCH_CPU_ISA=", name, ": this ",
                      tier.cpu_has() ? "build did not compile that tier" : "CPU lacks that instruction set",
                      "; it supports ", c10::Join(", ", supported_cpu_isas()));
    chosen().store(tier.kernels());
    return;
  }
  TORCH_CHECK_VALUE(false, "CONTBATCH_CPU_ISA must be auto, generic, avx2, avx512 or avx512_bf16, got '", name,
                    "' (this CPU and build support ", c10::Join(", ", supported_cpu_isas()), ")");
}

std::vector<std::string> supported_cpu_isas() {
  std::vector<std::string> names;
  for (const Tier& tier : kTiers) {
    if (runnable(tier) != nullptr) names.emplace_back(tier.name);
  }
  return names;
}

}  // namespace contbatch::cpu

namespace contbatch {
std::string cpu_kernel_isa() { return cpu::active_kernels().isa; }
void set_cpu_isa(std::string isa) { cpu::set_cpu_isa(isa); }
std::vector<std::string> supported_cpu_isas() { return cpu::supported_cpu_isas(); }
}  // namespace contbatch
