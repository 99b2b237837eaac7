// The body of every int8_<tier>.cpp: the int8 linear kernel instantiated for one tier, as
// kTierTable (an Int8Kernels). Included after the tier's simd header, inside namespace
// contbatch::cpu and an anonymous namespace, with CONTBATCH_TIER_INT8 naming its int8 section.
#include "layers_kernel.h"
#include "linear_tiles.h"
#include CONTBATCH_TIER_INT8
#include "int8_linear_kernel.h"
