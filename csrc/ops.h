// CPU entry points of the ops defined in torch_bindings.cpp (schemas there). The CUDA ones
// are registered by csrc/cuda/*.cu themselves. Shapes and layouts: docs/design/kv_cache_layout.md
// and the top of op_checks.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace contbatch {

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping);
void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, int64_t sliding_window);
void copy_blocks_cpu(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                     const at::Tensor& block_mapping);

// Fused layer ops (CPU only; on GPU the engine uses their PyTorch references).
void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps);
void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                          const at::Tensor& sin);
// out[r] = index of the first maximum of logits[r] (NaN largest), as torch.max(dim=-1); CPU only.
void argmax_rows_cpu(at::Tensor& out, const at::Tensor& logits);
// out[r] = a token drawn from logits[r] by temperature, min-p, top-k and top-p (temperature 0:
// argmax) with uniform[r]; -1 where every token is masked out. CPU only.
void sample_rows_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniform);

// bf16 linear over panel-packed weights (csrc/cpu/linear_kernel_api.h), CPU only.
void bf16_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                     const std::optional<at::Tensor>& bias);

// int8 ops (csrc/cpu/int8_kernel_api.h), CPU only: per-token, per-block quantization of
// fp32/bf16 rows (blocks of `block` inputs: 32 or 64), and the linear layer over a
// block-quantized, panel-packed weight (its activations quantized in its blocks).
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows_cpu(const at::Tensor& input, int64_t block);
// weight_offset: what the stored weights add to q, 128 or 64 (narrow weights, |q| <= 64).
void int8_linear_cpu(at::Tensor& out, const at::Tensor& x_values, const at::Tensor& x_scales,
                     const at::Tensor& values, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t weight_offset);
// Both in one call: a decode step's 121 linear layers each save an op dispatch and two
// tensor allocations in Python (int8_linear's inputs are those of int8_quantize_rows).
void int8_quantize_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& values,
                              const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                              int64_t weight_offset);
// Which int8 kernel runs now ("generic", "avx2", "avx_vnni" or "avx512_vnni").
std::string int8_kernel_isa();
// Runs int8 kernel `name` from now on, whatever the tier ("auto" or "": chosen by the tier),
// and returns the setting before ("auto" or a name); ValueError naming the runnable ones for
// a kernel this CPU or build cannot run.
std::string set_int8_kernel(std::string name);
std::vector<std::string> supported_int8_kernels();

// The CPU kernels' ISA tier (csrc/cpu/cpu_isa.h): the one the ops run now, choosing one by
// name ("auto", "generic", "avx2", "avx512", "avx512_bf16"), those this CPU can run, and
// the one "auto" chooses.
std::string cpu_kernel_isa();
void set_cpu_isa(std::string isa);
std::vector<std::string> supported_cpu_isas();
std::string best_cpu_isa();
// Whether bf16 linears of many rows run on the AMX kernel now (csrc/cpu/cpu_isa.h,
// amx_linear_kernels), and switching AMX (bf16 and int8) on or off (returns the setting before).
bool amx_linears();
bool set_amx_linears(bool on);
// Whether int8 linears of many rows run on the AMX int8 kernel now (amx_int8_linear_kernels).
bool amx_int8_linears();
// Whether bf16 linears of 2 row tiles or more widen each panel to fp32 first now
// (csrc/cpu/cpu_isa.h, widened_linear_kernels), and switching that on or off (returns the setting before).
bool widened_linears();
bool set_widened_linears(bool on);

}  // namespace contbatch
