// CPU driver of the bf16 linear op over panel-packed weights (layout: linear_kernel_api.h):
// argument checks, threads over equal shares of (panel, row tile) units (panel_runs.h),
// each on the active ISA tier's kernel (cpu_isa.h), or for calls of many rows on AMX CPUs,
// the AMX kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../op_checks.h"
#include "../ops.h"
#include "cpu_isa.h"
#include "linear_kernel_api.h"
#include "panel_runs.h"

namespace contbatch {
namespace {

// Calls of this many rows or more take the AMX kernel where it runs (cpu_isa.h): at 1-4 rows
// the vector kernel streams the weights as fast or faster (docs/performance.md, AMX).
constexpr int64_t kAmxMinRows = 5;
// The AMX kernel multiplies 32 inputs a tile; other widths stay on the vector kernel.
constexpr int64_t kAmxInputMultiple = 32;

// The kernel a call of `rows` x `in_features` runs on: AMX, else the widened kernel where it
// runs (it leaves runs of fewer than 2 row tiles to the direct loop), else the tier's vector kernel.
const cpu::LinearKernels& linear_kernels_for(int64_t rows, int64_t in_features) {
  if (rows >= kAmxMinRows && in_features % kAmxInputMultiple == 0) {
    if (const cpu::LinearKernels* amx = cpu::amx_linear_kernels()) return *amx;
  }
  const cpu::LinearKernels* widened = cpu::widened_linear_kernels();
  return widened != nullptr ? *widened : *cpu::active_kernels().linear;
}

void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "bf16_linear: ", name, " must be torch.bfloat16, got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device().is_cpu(), "bf16_linear: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, "bf16_linear: ", name,
                    " must be 2-D [rows, features] with contiguous rows, got shape ", t.sizes(), " strides ",
                    t.strides());
}

}  // namespace

void bf16_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                     const std::optional<at::Tensor>& bias) {
  check_bf16_matrix(input, "input");
  check_bf16_matrix(out, "out");
  const int64_t rows = input.size(0), in_features = input.size(1), out_features = out.size(1);
  TORCH_CHECK_VALUE(out.size(0) == rows, "bf16_linear: out has ", out.size(0), " rows, input ", rows);
  const int64_t panels = (out_features + cpu::kPanelColumns - 1) / cpu::kPanelColumns;
  const int64_t pairs = (in_features + 1) / 2;
  TORCH_CHECK_VALUE(packed_weight.scalar_type() == at::kBFloat16 && packed_weight.is_contiguous() &&
                        packed_weight.sizes() == at::IntArrayRef({panels, pairs, cpu::kPanelColumns, 2}),
                    "bf16_linear: packed_weight must be contiguous bfloat16 [", panels, ", ", pairs, ", ",
                    cpu::kPanelColumns, ", 2] for ", out_features, " outputs of ", in_features,
                    " inputs, got shape ", packed_weight.sizes());
  const uint16_t* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->is_contiguous() &&
                          bias->size(0) == out_features,
                      "bf16_linear: bias must be contiguous bfloat16 [", out_features, "], got shape ", bias->sizes());
    bias_data = static_cast<const uint16_t*>(bias->data_ptr());
  }
  if (rows == 0 || out_features == 0) return;
  const cpu::LinearKernels& kernels = linear_kernels_for(rows, in_features);
  const auto* x = static_cast<const uint16_t*>(input.data_ptr());
  const auto* weight = static_cast<const uint16_t*>(packed_weight.data_ptr());
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  const int64_t panel_elements = pairs * 2 * cpu::kPanelColumns;
  for_panel_runs(rows, panels, kernels.tile_rows, kernels.scratch_bytes(in_features),
                 [&](PanelRun run, void* scratch) {
                   const int64_t column0 = run.panel * cpu::kPanelColumns;
                   kernels.bf16_panel(x + run.row0 * input.stride(0), input.stride(0), run.rows, in_features,
                                      weight + run.panel * panel_elements,
                                      bias_data == nullptr ? nullptr : bias_data + column0,
                                      o + run.row0 * out.stride(0) + column0, out.stride(0),
                                      std::min(cpu::kPanelColumns, out_features - column0), scratch);
                 },
                 kernels.run_rows);
}

}  // namespace contbatch
