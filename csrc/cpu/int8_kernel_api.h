// Function table of the int8 linear kernel (int8_linear_kernel.h), one per int8 tier.
//
// Layouts (contbatch/ops/int8_blocks.py): a row is cut into blocks of 32 or 64 inputs (one
// size per weight: 32 is a GGUF file's Q8_0, 64 what contbatch quantizes with), each block
// signed 8-bit values q in [-127, 127] and one scale. Weights are panels of 64 output columns:
// values[panel][block][quad][column][4] holds the column's inputs block_inputs * block +
// 4 * quad + 0..3 as unsigned bytes q + o, and per panel, block and column an fp16 scale.
// o, the weight's offset, is 128, or 64 for narrow weights (|q| <= 64, which AVX2 multiplies
// without vpsignb: simd_int8_avx2.h). Activations are rows of values [rows][blocks *
// block_inputs] (signed), quantized in the weight's blocks, with fp32 scales [rows][blocks];
// the driver adds each row's offsets [rows][blocks], -o * (the block's sum of values), which
// take the weights' +o out of every block's dot product.
//
// The int8 tiers are their own choice, made from the active ISA tier (int8_linear.cpp):
// VNNI (vpdpbusd) wherever the CPU has AVX512_VNNI and an AVX-512 tier runs; else AVX-VNNI
// (the 256-bit vpdpbusd) where the CPU has it, else AVX2's vpmaddubsw, under the AVX2 tier and
// on AVX-512 CPUs without VNNI; portable C++ under the generic tier. set_int8_kernel (ops.h)
// overrides the choice for tests and benchmarks.
#pragma once

#include <cstdint>

namespace contbatch::cpu {

// The block sizes the kernels serve (inputs a block), and the columns of a panel.
constexpr int64_t kInt8Q8Block = 32;
constexpr int64_t kInt8WideBlock = 64;
inline bool int8_block_served(int64_t block_inputs) {
  return block_inputs == kInt8Q8Block || block_inputs == kInt8WideBlock;
}
constexpr int64_t kInt8PanelColumns = 64;
// The weights' offsets o (above): 8-bit weights, and narrow ones.
constexpr int32_t kInt8WeightOffset = 128;
constexpr int32_t kInt8NarrowOffset = 64;

// Scratch one panel call needs: a 64-byte header the driver zeroes before a thread's first
// task of each call (for a tier's copy of the panel: none keeps one now, since AVX2's
// vpmaddwd kernel, which widened the panel to int16, gave way to vpmaddubsw on 2026-12-02).
constexpr int64_t kInt8ScratchHeader = 64;
inline int64_t int8_scratch_bytes(int64_t /*padded_inputs*/) { return kInt8ScratchHeader; }

template <class T>  // T: float or uint16_t (bf16 bits), the activations' and output's type
using Int8PanelFn = void (*)(const int8_t* x, int64_t x_stride, const float* x_scales, const int32_t* x_offsets,
                             int64_t rows, int64_t blocks, int64_t block_inputs, const uint8_t* values,
                             const uint16_t* scales, const T* bias, T* out, int64_t out_stride, int64_t columns,
                             void* scratch, const uint8_t* next_values);

template <class T>
struct Int8TypedKernels {
  // out[rows, columns] = x . panel (+ bias[columns]) for one panel (columns <= 64; bias may
  // be nullptr) of `blocks` blocks of block_inputs inputs (int8_block_served), x's rows
  // (x_stride bytes apart) as quantized (int8), their offsets x_offsets ([rows][blocks]):
  // the int32 dot product of each block plus its offset, times the row's and column's
  // scales, summed over blocks in fp32 and rounded to T once, after the bias. `scratch`
  // holds int8_scratch_bytes(blocks * block_inputs), 64-byte aligned, private to the calling
  // thread, its header zeroed by the driver before the thread's first task of the call.
  // next_values: the packed weights of the panel the calling thread reads after this one in
  // the call (the next in memory), which a kernel may prefetch while it reads this one from
  // cache; nullptr where the thread reads no other (its last task of the call).
  Int8PanelFn<T> panel;
  // One row of in_features inputs into blocks of block_inputs (int8_block_served): scale =
  // max|x| / 127, q = round-half-even(x * (127 / max|x|)), zero past in_features up to whole
  // blocks.
  void (*quantize_row)(const T* x, int64_t in_features, int64_t block_inputs, int8_t* values, float* scales);
  // One K or V row of head_size values (a multiple of 16, at most 256) as an int8 cache row
  // (docs/design/kv_cache_layout.md): quantized as one block by quantize_row's rule, then
  // the scale's 4 bytes.
  void (*quantize_kv_row)(const T* x, int64_t head_size, int8_t* row);
  // panel for narrow weights (offset 64) where the tier reads them its own way; nullptr where
  // panel serves them (it adds the offsets whatever they are).
  Int8PanelFn<T> narrow_panel = nullptr;
  // panel, but a call whose rows one panel-spanning tile holds reads the weights with the
  // hardware prefetcher alone, without the tile's software prefetches ahead
  // (int8_linear_kernel.h); nullptr where the tier has no such variant. The driver takes it
  // on the CPUs where that reads faster (int8_linear.cpp, lone_tiles_read_faster_unprefetched).
  Int8PanelFn<T> panel_without_prefetch = nullptr;
};

struct Int8Kernels {
  const char* name;
  int64_t tile_rows;  // rows of the panel kernel's register tile: the driver's unit of work (panel_runs.h)
  const Int8TypedKernels<float>* fp32;
  const Int8TypedKernels<uint16_t>* bf16;
  int64_t (*scratch_bytes)(int64_t padded_inputs);  // what a panel call's `scratch` must hold
  int64_t run_rows;  // rows of one panel call at most (a multiple of tile_rows)
};

// nullptr where this build could not compile the tier (as kernel_set.h's getters).
const Int8Kernels* int8_generic_kernels();
const Int8Kernels* int8_avx2_kernels();
const Int8Kernels* int8_avx_vnni_kernels();
const Int8Kernels* int8_avx512_vnni_kernels();
// The AMX kernel (int8_amx_kernel.h): panels only (quantize_row and quantize_kv_row are
// nullptr), for calls of many rows of 64-input blocks staged as the VNNI kernel stages them.
const Int8Kernels* int8_amx_kernels();

}  // namespace contbatch::cpu

namespace contbatch {
// The int8 kernels int8 ops run now (int8_linear.cpp).
const cpu::Int8Kernels& active_int8_kernels();
}  // namespace contbatch
