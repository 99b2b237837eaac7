// Which ISA tier of the CPU kernels runs: the best one this CPU and build have, unless
// set_cpu_isa() chose another (CONTBATCH_CPU_ISA, read once by contbatch.ops at import,
// or tests comparing tiers in one process). The choice is read on every op call as one
// atomic load; nothing is looked up in the environment on a hot path.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "int8_kernel_api.h"
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

// The AMX bf16 linear kernel (linear_amx_kernel.h) where it runs now: a CPU with AMX-TILE
// and AMX-BF16 whose kernel (Linux) may use the tile registers, a build that compiled it,
// an AVX-512 tier chosen (a lower one, forced, stands for a CPU without AMX) and AMX not
// switched off (set_amx_linears); else nullptr.
const LinearKernels* amx_linear_kernels();
// The AMX int8 linear kernel (int8_amx_kernel.h) where it runs now: as amx_linear_kernels,
// with AMX-INT8.
const Int8Kernels* amx_int8_linear_kernels();
// Switches the AMX kernels (bf16 and int8) on or off (CONTBATCH_AMX=0, read by contbatch.ops at import);
// returns the setting before. On where the CPU lacks AMX changes nothing.
bool set_amx_linears(bool on);

// The active tier's widened bf16 linear kernel (KernelSet::widened_linear) where it runs now:
// a tier without bf16 dot products and widening switched on, by default on Intel CPUs only
// (cpu_isa.cpp says why); else nullptr.
const LinearKernels* widened_linear_kernels();
// Switches the widened kernel on or off (tests run both on any CPU); returns the setting before.
bool set_widened_linears(bool on);

}  // namespace contbatch::cpu
