// The CPU kernels of one ISA tier, as function tables, and the tiers this build compiled.
// No ATen here: the kernel translation units (kernels_<tier>.cpp) are compiled for other
// target ISAs and must not share inline code with the rest of the extension.
#pragma once

#include "attention_kernel_api.h"
#include "layers_kernel_api.h"
#include "linear_kernel_api.h"

namespace contbatch::cpu {

struct KernelSet {
  const char* isa;  // the tier's name, as CONTBATCH_CPU_ISA spells it
  const AttentionKernels* attention;
  const LayerKernelSet* layers;
  const LinearKernels* linear;
  // The bf16 linear with each panel widened to fp32 first (linear_kernel.h) for runs of 2 row
  // tiles or more, where that pays (cpu_isa.h); nullptr on tiers with bf16 dot products.
  const LinearKernels* widened_linear;
};

// One per tier, defined in kernels_<tier>.cpp; nullptr where this build could not compile
// the tier (a compiler other than GCC, or not x86-64). Call a kernel only on a CPU that
// has the tier's ISA (cpu_isa.h checks).
const KernelSet* generic_kernel_set();      // any CPU: portable C++
const KernelSet* avx2_kernel_set();         // AVX2 + FMA + F16C
const KernelSet* avx512_kernel_set();       // AVX-512 F/BW/VL/DQ (bf16 dot products emulated)
const KernelSet* avx512_bf16_kernel_set();  // the same + AVX512_BF16 (vdpbf16ps)

// The bf16 linear kernel on AMX tiles (linear_amx_kernel.h), for calls of many rows beside
// an AVX-512 tier's; nullptr where this build could not compile it.
const LinearKernels* amx_bf16_linear_kernels();  // the AVX512_BF16 tier's ISA + AMX-TILE, AMX-BF16

}  // namespace contbatch::cpu
