// The body shared by every kernels_<tier>.cpp: included inside namespace contbatch::cpu
// and an anonymous namespace, after that tier's simd header and with CONTBATCH_TIER_NAME
// defined, it instantiates every kernel for the tier and collects them in kTierTable.
// The kernels are written once against the Vec16 functions; only the simd header differs
// between tiers.
#include "attention_kernel.h"
#include "layers_kernel.h"
#include "linear_tiles.h"
#include "linear_kernel.h"

constexpr LayerKernelSet kTierLayerKernels{&kLayerKernels<float>, &kLayerKernels<uint16_t>, &first_above};
constexpr LinearKernels kTierLinearKernels{&linear_bf16_panel, kLinearTileRows, &linear_scratch_bytes,
                                                kVectorRunRows};
#ifdef CONTBATCH_WIDENS_PANELS
constexpr LinearKernels kTierWidenedLinearKernels{&linear_bf16_widened, kLinearTileRows, &widened_linear_scratch_bytes,
                                                  kVectorRunRows};
constexpr const LinearKernels* kTierWidenedLinear = &kTierWidenedLinearKernels;
#else
constexpr const LinearKernels* kTierWidenedLinear = nullptr;
#endif
constexpr KernelSet kTierTable{CONTBATCH_TIER_NAME, &kKernels, &kTierLayerKernels, &kTierLinearKernels,
                               kTierWidenedLinear};
