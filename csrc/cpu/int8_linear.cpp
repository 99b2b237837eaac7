// CPU driver of the int8 ops (layouts: int8_kernel_api.h): activation quantization, threads
// over rows; the int8 linear, threads over equal shares of (panel, row tile) units
// (panel_runs.h). Each runs the int8 kernels that go with the active ISA tier (cpu_isa.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "../op_checks.h"
#include "../ops.h"
#include "cpu_isa.h"
#include "int8_kernel_api.h"
#include "panel_runs.h"

namespace contbatch {
namespace {

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_avx_vnni() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

// The int8 kernels this CPU and build can run, slowest first.
const std::vector<const cpu::Int8Kernels*>& runnable_int8_kernels() {
  static const std::vector<const cpu::Int8Kernels*> runnable = [] {
    const auto tiers = supported_cpu_isas();  // the ISAs this CPU and its OS run
    const auto runs = [&](const char* tier) { return std::find(tiers.begin(), tiers.end(), tier) != tiers.end(); };
    std::vector<const cpu::Int8Kernels*> kernels{cpu::int8_generic_kernels()};
    for (const auto& [usable, kernel] :
         {std::pair{runs("avx2"), cpu::int8_avx2_kernels()},
          std::pair{runs("avx2") && cpu_has_avx_vnni(), cpu::int8_avx_vnni_kernels()},
          std::pair{runs("avx512") && cpu_has_avx512_vnni(), cpu::int8_avx512_vnni_kernels()}}) {
      if (usable && kernel != nullptr) kernels.push_back(kernel);
    }
    return kernels;
  }();
  return runnable;
}

const cpu::Int8Kernels* runnable_int8_kernel(std::string_view name) {
  for (const cpu::Int8Kernels* kernel : runnable_int8_kernels()) {
    if (kernel->name == name) return kernel;
  }
  return nullptr;
}

// The first of `names` this CPU and build run, else the portable kernels.
const cpu::Int8Kernels* best_of(std::initializer_list<std::string_view> names) {
  for (std::string_view name : names) {
    if (const cpu::Int8Kernels* kernel = runnable_int8_kernel(name)) return kernel;
  }
  return cpu::int8_generic_kernels();
}

// Whether a call of a few rows (one tile that spans the panel: up to 4 rows on the VNNI
// kernel) reads its weights faster with the hardware prefetcher alone than with the tile's
// software prefetches 8 KiB ahead (linear_tiles.h). On a Zen 4 it does: SmolLM2's int8 decode
// steps with 1, 2 and 4 requests running took 0.89-0.92x, 0.92-0.96x and 0.92x the time
// without them (two runs, each one process alternating both ways 8 and 10 times; medians of
// the paired ratios, 2026-12-07). With 8 running (two 4-row tiles) dropping the first tile's
// prefetches too made steps slower (1.13x), so calls of more rows keep them. With them a
// thread read one row's weights at 16-17 GB/s inside a step (rdtsc around each thread's
// share), at every projection size from 0.34 to 29 MB: a bound of each core's outstanding
// misses, not of the calls' size or count. On an Emerald Rapids Xeon they made one row 5-40%
// faster (2026-11-25, an earlier kernel), so Intel keeps them; on a Zen 5 (AMD family 1Ah)
// dropping every prefetch made 8-row calls 1.9x slower (docs/design/experiments.md,
// 2026-11-26), and one-tile calls alone were not tried there, so it keeps them too.
bool lone_tiles_read_faster_unprefetched() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amdfam19h");
#else
  return false;
#endif
}

// set_int8_kernel's choice; nullptr: the tier's. Read on every op call, as the tier is.
std::atomic<const cpu::Int8Kernels*> forced_int8_kernel{nullptr};

template <class T>
const cpu::Int8TypedKernels<T>& typed(const cpu::Int8Kernels& kernels) {
  if constexpr (std::is_same_v<T, float>) {
    return *kernels.fp32;
  } else {
    return *kernels.bf16;
  }
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
                   " must be torch.float32 or torch.bfloat16, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
                    " must be 2-D [rows, features] with contiguous rows, got shape ", t.sizes(), " strides ",
                    t.strides());
}

// Inputs a block of the packed weight `values` [panels, blocks, quads, 64, 4]: 4 x quads.
int64_t weight_block_inputs(const at::Tensor& values) {
  TORCH_CHECK_VALUE(values.dim() == 5 && cpu::int8_block_served(values.size(2) * 4),
                    "int8_linear: values must be [panels, blocks, 8 or 16, 64, 4] (blocks of 32 or 64 inputs), "
                    "got shape ", values.sizes());
  return values.size(2) * 4;
}

void check_exact(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == shape,
                    "int8_linear: ", name, " must be a contiguous CPU ", dtype_name(dtype), " tensor of shape ",
                    shape, ", got ", dtype_name(t.scalar_type()), " ", t.sizes(), " on ", t.device());
}

// Quantizes input's rows into q [rows][blocks * block_inputs] and s [rows][blocks], in
// blocks of block_inputs, handing each row's index to then(r) once it is quantized.
template <class T, class Then>
void quantize_rows(const cpu::Int8Kernels& kernels, const at::Tensor& input, int64_t block_inputs, int8_t* q, float* s,
                   const Then& then) {
  const auto& kernel = typed<T>(kernels);
  const auto* x = static_cast<const T*>(input.data_ptr());
  const int64_t in_features = input.size(1), blocks = (in_features + block_inputs - 1) / block_inputs;
  const int64_t padded = blocks * block_inputs;
  at::parallel_for(0, input.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      kernel.quantize_row(x + r * input.stride(0), in_features, block_inputs, q + r * padded, s + r * blocks);
      then(r);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize(const cpu::Int8Kernels& kernels, const at::Tensor& input,
                                            int64_t block_inputs) {
  const int64_t rows = input.size(0);
  const int64_t blocks = (input.size(1) + block_inputs - 1) / block_inputs;
  at::Tensor values = at::empty({rows, blocks * block_inputs}, input.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, blocks}, input.options().dtype(at::kFloat));
  auto* q = values.data_ptr<int8_t>();
  auto* s = scales.data_ptr<float>();
  const auto nothing_more = [](int64_t) {};
  if (input.scalar_type() == at::kFloat) {
    quantize_rows<float>(kernels, input, block_inputs, q, s, nothing_more);
  } else {
    quantize_rows<uint16_t>(kernels, input, block_inputs, q, s, nothing_more);
  }
  return {values, scales};
}

// A call's inputs as the panels read them (int8, as quantized), with each row's
// block scales and offsets ([rows][blocks]; an offset is -o * the block's sum of values,
// which cancels the +o that the packed weights carry, q + o, in the block's dot product).
struct StagedInputs {
  const int8_t* values;
  int64_t stride;        // bytes from one row of values to the next
  const float* scales;
  const int32_t* offsets;
};

// Staging of up to this many bytes lives in a buffer the calling thread keeps across calls;
// more (prefill-sized calls) in a tensor of its own. A decode step makes 121 int8 calls, and
// at one row the three tensors allocated for the staging (with the checks on them) took
// about 3 of the 4.5 us a call spent before its threads started, against 1.3 us for a bf16
// call (Zen 4, rdtsc in the decoder stack).
constexpr int64_t kReusedStagingBytes = 1 << 20;

constexpr int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// `bytes` of 64-byte aligned memory for one call's staging: the calling thread's buffer, or
// `storage` allocated for it.
char* staging_memory(int64_t bytes, at::Tensor& storage) {
  if (bytes > kReusedStagingBytes) {
    storage = at::empty({bytes + 64}, at::TensorOptions().dtype(at::kByte));
    return reinterpret_cast<char*>(aligned64(reinterpret_cast<intptr_t>(storage.data_ptr())));
  }
  return thread_buffer<StagedInputs>(bytes);
}

// One call's staging memory: offsets, then scales and values for the rows the op quantizes
// itself. weight_offset: the weight's o (int8_kernel_api.h).
class Staging {
 public:
  Staging(int64_t rows, int64_t blocks, int64_t block_inputs, int32_t weight_offset, at::Tensor& storage)
      : blocks_(blocks), block_inputs_(block_inputs), row_inputs_(blocks * block_inputs),
        weight_offset_(weight_offset) {
    char* memory = staging_memory(bytes(rows, blocks, block_inputs), storage);
    offsets_ = reinterpret_cast<int32_t*>(memory);
    scales = reinterpret_cast<float*>(memory + scales_at(rows, blocks));
    values = reinterpret_cast<int8_t*>(memory + values_at(rows, blocks));
  }

  // The staging memory of a call of `rows` rows.
  static int64_t bytes(int64_t rows, int64_t blocks, int64_t block_inputs) {
    return values_at(rows, blocks) + aligned64(rows * blocks * block_inputs);
  }

  // Row r's offsets from its quantized values.
  void stage_row(int64_t r, const int8_t* row_values) const {
    for (int64_t b = 0; b < blocks_; ++b) {
      int32_t sum = 0;
      for (int64_t k = 0; k < block_inputs_; ++k) sum += row_values[b * block_inputs_ + k];
      offsets_[r * blocks_ + b] = -weight_offset_ * sum;
    }
  }

  // The staged call over quantized rows at x_values (row_inputs apart) with their x_scales.
  StagedInputs inputs(const int8_t* x_values, const float* x_scales) const {
    return {x_values, row_inputs_, x_scales, offsets_};
  }

  float* scales;   // [rows][blocks], for the rows the op quantizes
  int8_t* values;  // [rows][row_inputs], likewise

 private:
  static int64_t scales_at(int64_t rows, int64_t blocks) { return aligned64(rows * blocks * 4); }
  static int64_t values_at(int64_t rows, int64_t blocks) { return scales_at(rows, blocks) + aligned64(rows * blocks * 4); }

  int64_t blocks_, block_inputs_, row_inputs_;
  int32_t weight_offset_;
  int32_t* offsets_;
};

// The fused op's staging: input's rows quantized in blocks of block_inputs, then staged.
template <class T>
StagedInputs quantize_and_stage(const cpu::Int8Kernels& kernels, const at::Tensor& input, int64_t block_inputs,
                                int32_t weight_offset, at::Tensor& storage) {
  const int64_t rows = input.size(0), blocks = (input.size(1) + block_inputs - 1) / block_inputs;
  const Staging staging(rows, blocks, block_inputs, weight_offset, storage);
  quantize_rows<T>(kernels, input, block_inputs, staging.values, staging.scales,
                   [&](int64_t r) { staging.stage_row(r, staging.values + r * blocks * block_inputs); });
  return staging.inputs(staging.values, staging.scales);
}

// int8_linear's staging: x_values and x_scales as given (quantized in the weight's blocks).
StagedInputs stage(const at::Tensor& x_values, const at::Tensor& x_scales, int64_t block_inputs,
                   int32_t weight_offset, at::Tensor& storage) {
  const int64_t rows = x_values.size(0), row_inputs = x_values.size(1);
  const Staging staging(rows, row_inputs / block_inputs, block_inputs, weight_offset, storage);
  const auto* values = x_values.data_ptr<int8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) staging.stage_row(r, values + r * row_inputs);
  });
  return staging.inputs(values, x_scales.data_ptr<float>());
}

// A call's inputs as its threads read them: staged once for all of them, or quantized and
// staged by each thread into its own buffer (stages_per_thread says when and why).
class CallInputs {
 public:
  explicit CallInputs(StagedInputs staged) : staged_(staged) {}
  // input's rows, quantized by kernels' quantize_row in blocks of block_inputs.
  CallInputs(const cpu::Int8Kernels& kernels, const at::Tensor& input, int64_t block_inputs, int32_t weight_offset)
      : kernels_(&kernels), input_(&input), block_inputs_(block_inputs), weight_offset_(weight_offset) {}

  // The staging the calling thread reads: where each thread stages its own, quantized now
  // into the thread's buffer (call once per thread and call).
  // Called inside the call's parallel region, where quantize_and_stage's parallel_for runs
  // on the calling thread alone (ATen runs nested parallel_for serially).
  template <class T>
  StagedInputs for_thread() const {
    if (input_ == nullptr) return staged_;
    at::Tensor unused;  // the staging fits the thread's buffer (stages_per_thread)
    return quantize_and_stage<T>(*kernels_, *input_, block_inputs_, weight_offset_, unused);
  }

 private:
  StagedInputs staged_{};
  const cpu::Int8Kernels* kernels_ = nullptr;
  const at::Tensor* input_ = nullptr;  // nullptr: staged_ serves every thread
  int64_t block_inputs_ = 0;
  int32_t weight_offset_ = 0;
};

// Each thread of an int8_quantize_linear call of kFewestRestagedRows rows or more quantizes
// and stages every row itself (stages_per_thread), while the threads after the first would
// quantize at most kRestagedRows rows again between them: up to 256 rows on two threads, 128
// on three, 16 on seventeen.
constexpr int64_t kFewestRestagedRows = 3;
constexpr int64_t kRestagedRows = 256;

// Whether each thread of an int8_quantize_linear call quantizes and stages every row itself,
// into its own buffer, rather than all of them reading one staging: written by the calling
// thread alone up to 16 rows, by each thread for its share of the rows above. Up to 16 rows
// the other threads waited while the calling thread quantized, so quantizing on all of them
// costs no time there; above, each quantizes every row where it quantized its share.
// Reading a staging that another core wrote is what costs: on a Zen 4 (thirty-first session,
// docs/performance.md), SmolLM2's int8 decode steps with the threads reading a stale staging
// (wrong results, a probe) took 0.80-0.88x the time at 8 running when those steps were in
// their slow state (9.5-10 ms) and 0.93-0.98x otherwise; prefetching the staging as each
// thread started recovered none of it (0.98x). Staging on every thread, both ways alternated
// in one process (medians of paired ratios): 3 / 4 / 8 running 0.98x / 0.91x / 0.91x the
// time, 16 / 64 / 256 running 0.84x / 0.97x / 0.92x; 1 and 2 running 1.007-1.011x in three
// runs each (a row or two of bf16 read from the other core where the staging was less), so
// calls of fewer than 3 rows keep the one staging.
bool stages_per_thread(int64_t rows, int64_t blocks, int64_t block_inputs) {
  return rows >= kFewestRestagedRows && rows * (at::get_num_threads() - 1) <= kRestagedRows &&
         Staging::bytes(rows, blocks, block_inputs) <= kReusedStagingBytes;
}

// The weight's offset and what it allows (int8_kernel_api.h).
struct WeightOffset {
  int32_t value;  // kInt8WeightOffset, or kInt8NarrowOffset: narrow weights
  bool narrow() const { return value == cpu::kInt8NarrowOffset; }
};

// block_inputs: values' block, which the inputs were quantized in.
template <class T>
void run_panels(const cpu::Int8Kernels& kernels, at::Tensor& out, const CallInputs& inputs,
                const at::Tensor& values, int64_t block_inputs, const at::Tensor& scales,
                const std::optional<at::Tensor>& bias, WeightOffset weight_offset) {
  const auto& typed_kernels = typed<T>(kernels);
  static const bool unprefetched = lone_tiles_read_faster_unprefetched();
  cpu::Int8PanelFn<T> panel = typed_kernels.panel;
  if (weight_offset.narrow() && typed_kernels.narrow_panel != nullptr) {
    panel = typed_kernels.narrow_panel;
  } else if (unprefetched && typed_kernels.panel_without_prefetch != nullptr) {
    panel = typed_kernels.panel_without_prefetch;
  }
  const int64_t rows = out.size(0), out_features = out.size(1);
  const int64_t panels = values.size(0), blocks = values.size(1);
  const int64_t panel_values = blocks * block_inputs * cpu::kInt8PanelColumns;
  const int64_t panel_scales = blocks * cpu::kInt8PanelColumns;
  const auto* w = values.data_ptr<uint8_t>();
  const auto* ws = static_cast<const uint16_t*>(scales.data_ptr());
  const T* b = bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr;
  auto* o = static_cast<T*>(out.data_ptr());
  for_panel_runs_started(
      rows, panels, kernels.tile_rows, kernels.scratch_bytes(blocks * block_inputs),
      [&] { return inputs.for_thread<T>(); },
      [&](PanelRun run, void* scratch, const StagedInputs& x) {
        const int64_t column0 = run.panel * cpu::kInt8PanelColumns;
        // No prefetching past the thread's share: the other thread's first panel or another
        // tensor (int8_linear_kernel.h, int8_row_tiles_of).
        const bool next_is_read = !run.last && run.panel + 1 < panels;
        panel(x.values + run.row0 * x.stride, x.stride, x.scales + run.row0 * blocks, x.offsets + run.row0 * blocks,
              run.rows, blocks, block_inputs, w + run.panel * panel_values, ws + run.panel * panel_scales,
              b == nullptr ? nullptr : b + column0, o + run.row0 * out.stride(0) + column0, out.stride(0),
              std::min(cpu::kInt8PanelColumns, out_features - column0), scratch,
              next_is_read ? w + (run.panel + 1) * panel_values : nullptr);
      },
      kernels.run_rows);
}

// Calls of this many rows or more of 64-input blocks take the AMX kernel where it runs
// (cpu_isa.h), their inputs staged for the VNNI kernel. Fewer are bound by reading the
// weights, which the VNNI kernel's panel-spanning tiles do well; AMX ran 16-64 rows 1.1-1.2x
// and 256+ rows 1.8-2x faster (docs/performance.md, "AMX for int8 weights too"), fewer rows
// were not tried.
constexpr int64_t kAmxInt8MinRows = 16;

// The panel kernel for a call staged for `kernels`: the AMX one where it takes the call.
const cpu::Int8Kernels& panel_kernels(const cpu::Int8Kernels& kernels, int64_t rows, int64_t block_inputs) {
  if (rows >= kAmxInt8MinRows && block_inputs == cpu::kInt8WideBlock && &kernels == cpu::int8_avx512_vnni_kernels()) {
    if (const cpu::Int8Kernels* amx = cpu::amx_int8_linear_kernels()) return *amx;
  }
  return kernels;
}

void run_panels_typed(const cpu::Int8Kernels& staged_for, at::Tensor& out, const CallInputs& inputs,
                      const at::Tensor& values, int64_t block_inputs, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias, WeightOffset weight_offset) {
  const cpu::Int8Kernels& kernels = panel_kernels(staged_for, out.size(0), block_inputs);
  if (out.scalar_type() == at::kFloat) {
    run_panels<float>(kernels, out, inputs, values, block_inputs, scales, bias, weight_offset);
  } else {
    run_panels<uint16_t>(kernels, out, inputs, values, block_inputs, scales, bias, weight_offset);
  }
}

WeightOffset check_weight_offset(const char* op, int64_t weight_offset) {
  TORCH_CHECK_VALUE(weight_offset == cpu::kInt8WeightOffset || weight_offset == cpu::kInt8NarrowOffset, op,
                    ": weight_offset must be ", cpu::kInt8WeightOffset, " or ", cpu::kInt8NarrowOffset,
                    " (narrow weights), got ", weight_offset);
  return {int32_t(weight_offset)};
}

// The weight's checks (values, scales, bias against out); returns its block size.
int64_t check_weight(const at::Tensor& out, const at::Tensor& values, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias) {
  check_rows(out, "int8_linear", "out");
  const int64_t out_features = out.size(1);
  const int64_t block_inputs = weight_block_inputs(values);
  const int64_t panels = values.size(0), blocks = values.size(1);
  TORCH_CHECK_VALUE(panels == (out_features + cpu::kInt8PanelColumns - 1) / cpu::kInt8PanelColumns,
                    "int8_linear: values has ", panels, " panels for ", out_features, " outputs");
  check_exact(values, at::kByte, {panels, blocks, block_inputs / 4, cpu::kInt8PanelColumns, 4}, "values");
  check_exact(scales, at::kHalf, {panels, blocks, cpu::kInt8PanelColumns}, "scales");
  if (bias.has_value()) check_exact(*bias, out.scalar_type(), {out_features}, "bias");
  return block_inputs;
}

}  // namespace

// Unless set_int8_kernel chose one: VNNI under either AVX-512 tier where the CPU has it;
// else AVX-VNNI's 256-bit vpdpbusd where the CPU has it (Intel's AVX2 client CPUs), else
// AVX2's vpmaddubsw kernel, under any tier but the generic one; portable C++ under that.
// Worked out once per tier, not on each call.
const cpu::Int8Kernels& active_int8_kernels() {
  if (const cpu::Int8Kernels* forced = forced_int8_kernel.load(std::memory_order_relaxed)) return *forced;
  static const cpu::Int8Kernels* const for_avx512 = best_of({"avx512_vnni", "avx_vnni", "avx2"});
  static const cpu::Int8Kernels* const for_avx2 = best_of({"avx_vnni", "avx2"});
  const std::string_view isa = cpu::active_kernels().isa;
  if (isa == "generic") return *cpu::int8_generic_kernels();
  return isa.substr(0, 6) == "avx512" ? *for_avx512 : *for_avx2;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows_cpu(const at::Tensor& input, int64_t block) {
  check_rows(input, "int8_quantize_rows", "input");
  TORCH_CHECK_VALUE(cpu::int8_block_served(block), "int8_quantize_rows: block must be 32 or 64, got ", block);
  return quantize(active_int8_kernels(), input, block);
}

void int8_linear_cpu(at::Tensor& out, const at::Tensor& x_values, const at::Tensor& x_scales,
                     const at::Tensor& values, const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                     int64_t weight_offset) {
  const int64_t block_inputs = check_weight(out, values, scales, bias);
  const WeightOffset offset = check_weight_offset("int8_linear", weight_offset);
  const int64_t rows = out.size(0), blocks = values.size(1);
  check_exact(x_values, at::kChar, {rows, blocks * block_inputs}, "x_values");
  check_exact(x_scales, at::kFloat, {rows, blocks}, "x_scales");
  if (rows == 0 || out.size(1) == 0) return;
  const cpu::Int8Kernels& kernels = active_int8_kernels();
  at::Tensor storage;
  run_panels_typed(kernels, out, CallInputs(stage(x_values, x_scales, block_inputs, offset.value, storage)), values,
                   block_inputs, scales, bias, offset);
}

void int8_quantize_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& values,
                              const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                              int64_t weight_offset) {
  TORCH_CHECK_VALUE(input.dim() == 2 && out.dim() == 2 && input.size(0) == out.size(0),
                    "int8_quantize_linear: input [rows, in_features] and out [rows, out_features] must have the "
                    "same rows, got ",
                    input.sizes(), " and ", out.sizes());
  TORCH_CHECK_TYPE(input.scalar_type() == out.scalar_type(),
                   "int8_quantize_linear: input and out must have one dtype, got ", dtype_name(input.scalar_type()),
                   " and ", dtype_name(out.scalar_type()));
  check_rows(input, "int8_quantize_rows", "input");
  const int64_t block_inputs = check_weight(out, values, scales, bias);
  const WeightOffset offset = check_weight_offset("int8_quantize_linear", weight_offset);
  const int64_t blocks = values.size(1);
  TORCH_CHECK_VALUE((input.size(1) + block_inputs - 1) / block_inputs == blocks, "int8_quantize_linear: input has ",
                    input.size(1), " features, the weight's ", blocks, " blocks of ", block_inputs, " take ",
                    (blocks - 1) * block_inputs + 1, " to ", blocks * block_inputs);
  if (out.size(0) == 0 || out.size(1) == 0) return;
  const cpu::Int8Kernels& kernels = active_int8_kernels();  // one kernel table for both steps
  if (stages_per_thread(input.size(0), blocks, block_inputs)) {
    return run_panels_typed(kernels, out, CallInputs(kernels, input, block_inputs, offset.value), values,
                            block_inputs, scales, bias, offset);
  }
  at::Tensor storage;
  const StagedInputs inputs = input.scalar_type() == at::kFloat
                                  ? quantize_and_stage<float>(kernels, input, block_inputs, offset.value, storage)
                                  : quantize_and_stage<uint16_t>(kernels, input, block_inputs, offset.value, storage);
  run_panels_typed(kernels, out, CallInputs(inputs), values, block_inputs, scales, bias, offset);
}

std::string int8_kernel_isa() { return active_int8_kernels().name; }

std::string set_int8_kernel(std::string name) {
  const cpu::Int8Kernels* kernel = nullptr;
  if (!name.empty() && name != "auto") {
    kernel = runnable_int8_kernel(name);
    if (kernel == nullptr) {
      std::string runnable;
      for (const cpu::Int8Kernels* k : runnable_int8_kernels()) runnable += std::string(runnable.empty() ? "" : ", ") + k->name;
      TORCH_CHECK_VALUE(false, "set_int8_kernel: this CPU or build cannot run the int8 kernel '", name,
                        "'; it can run: auto, ", runnable);
    }
  }
  const cpu::Int8Kernels* before = forced_int8_kernel.exchange(kernel, std::memory_order_relaxed);
  return before == nullptr ? "auto" : before->name;
}

std::vector<std::string> supported_int8_kernels() {
  std::vector<std::string> names;
  for (const cpu::Int8Kernels* kernel : runnable_int8_kernels()) names.emplace_back(kernel->name);
  return names;
}

}  // namespace contbatch
