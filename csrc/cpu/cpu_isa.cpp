// Run-time choice of the CPU kernels' ISA tier (cpu_isa.h).
#include "cpu_isa.h"

#include "../ops.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace contbatch::cpu {
namespace {

struct Tier {
  const char* name;
  const KernelSet* (*kernels)();  // returns nullptr where this build did not compile the tier
  bool (*cpu_has)();
  bool (*auto_takes)();  // whether "auto" may pick it where the CPU has it
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

// Whether vdpbf16ps beats fp32 FMAs on bf16 pairs. On AMD (Zen 4) it does twice an FMA's
// work a cycle (bf16 matmul peak 427 against 190 GFLOP/s fp32). On Intel (measured on an
// Emerald Rapids Xeon) it runs at half the FMA rate: torch's bf16 matmul peak 164 against
// 317 GFLOP/s fp32, and contbatch's linear kernel took 3.1 ms a 256-row SmolLM2 MLP
// projection with it against 2.3 ms on the avx512 tier, which widens bf16 to fp32 FMAs.
bool bf16_dot_products_pay() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// Slowest first.
constexpr Tier kTiers[] = {
    {"generic", &generic_kernel_set, &any_cpu, &any_cpu},
    {"avx2", &avx2_kernel_set, &has_avx2, &any_cpu},
    {"avx512", &avx512_kernel_set, &has_avx512, &any_cpu},
    {"avx512_bf16", &avx512_bf16_kernel_set, &has_avx512_bf16, &bf16_dot_products_pay},
};

const KernelSet* runnable(const Tier& tier) { return tier.cpu_has() ? tier.kernels() : nullptr; }

// The fastest tier this CPU runs: the last runnable one that "auto" takes (a tier it skips
// stays available by name).
const KernelSet* best_kernels() {
  const KernelSet* best = nullptr;
  for (const Tier& tier : kTiers) {
    const KernelSet* set = runnable(tier);
    if (set != nullptr && tier.auto_takes()) best = set;
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

std::string best_cpu_isa() { return best_kernels()->isa; }

namespace {

// Linux keeps the AMX tile registers off until a process asks for them (a tile instruction
// before that raises SIGILL): arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once.
bool tile_data_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr int kArchRequestXcompPerm = 0x1023;
  constexpr int kXfeatureTileData = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
  return permitted;
#else
  return false;
#endif
}

bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
  __builtin_cpu_init();
  return has_avx512_bf16() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}

bool cpu_has_amx_int8() {
#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
  __builtin_cpu_init();
  return cpu_has_amx_bf16() && __builtin_cpu_supports("amx-int8");
#else
  return false;
#endif
}

bool avx512_tier_runs() {
  const KernelSet& tier = active_kernels();
  return &tier == avx512_kernel_set() || &tier == avx512_bf16_kernel_set();
}

std::atomic<bool>& amx_switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

// Whether an AMX kernel runs now: the CPU and build can (`supported`, worked out once by the
// caller), AMX is switched on, and an AVX-512 tier runs.
bool amx_runs(bool supported) {
  return supported && amx_switched_on().load(std::memory_order_relaxed) && avx512_tier_runs();
}

}  // namespace

const LinearKernels* amx_linear_kernels() {
  static const bool supported = cpu_has_amx_bf16() && amx_bf16_linear_kernels() != nullptr && tile_data_permitted();
  return amx_runs(supported) ? amx_bf16_linear_kernels() : nullptr;
}

const Int8Kernels* amx_int8_linear_kernels() {
  static const bool supported = cpu_has_amx_int8() && int8_amx_kernels() != nullptr && tile_data_permitted();
  return amx_runs(supported) ? int8_amx_kernels() : nullptr;
}

bool set_amx_linears(bool on) { return amx_switched_on().exchange(on); }

namespace {

// Whether widening a whole panel to fp32 before the FMAs beats widening each weight in the
// loop. On Intel it does: an Emerald Rapids Xeon ran a 256-row SmolLM2 MLP projection in 3.65
// ms widened against 4.2-5.3 on its avx2 tier (2026-11-25). On AMD it does not: on a Zen 3
// (avx2 tier, 2026-12-02) the direct kernel ran SmolLM2's 121 projections 1.3-1.4x faster
// at every count of 16-720 rows (94 against 72 GFLOP/s at 256 rows: benchmarks/linear.py,
// docs/performance.md), its 576- and 1536-input projections alike.
bool widening_pays() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

std::atomic<bool>& widening_switched_on() {
  static std::atomic<bool> on{widening_pays()};
  return on;
}

}  // namespace

const LinearKernels* widened_linear_kernels() {
  return widening_switched_on().load(std::memory_order_relaxed) ? active_kernels().widened_linear : nullptr;
}

bool set_widened_linears(bool on) { return widening_switched_on().exchange(on); }

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
std::string best_cpu_isa() { return cpu::best_cpu_isa(); }
bool amx_linears() { return cpu::amx_linear_kernels() != nullptr; }
bool set_amx_linears(bool on) { return cpu::set_amx_linears(on); }
bool amx_int8_linears() { return cpu::amx_int8_linear_kernels() != nullptr; }
bool widened_linears() { return cpu::widened_linear_kernels() != nullptr; }
bool set_widened_linears(bool on) { return cpu::set_widened_linears(on); }
}  // namespace contbatch
