// Which ISA tier of the CPU kernels runs: the best one this CPU and build have, unless
// set_cpu_isa() chose another (CONTBATCH_CPU_ISA, read once by contbatch.ops at import,
// or tests comparing tiers in one process). The choice is read on every op call as one
// atomic load; nothing is looked up in the environment on a hot path.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernel_set.h"

namespace contbatch::cpu {

// The kernels of the tier chosen now.
const KernelSet& active_kernels();

// Chooses a tier by name: "auto" (the best this CPU has), "generic", "avx2", "avx512" or
// "avx512_bf16". Raises ValueError for another name or a tier this CPU or build lacks.
void set_cpu_isa(std::string_view name);

// The tier "auto" chooses on this CPU.
std::string best_cpu_isa();

// The tiers this CPU and build can run, slowest first ("generic" is always there).
std::vector<std::string> supported_cpu_isas();

}  // namespace contbatch::cpu
