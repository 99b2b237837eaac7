// CPU drivers of the fused layer ops and the greedy sampler's argmax: argument checks, ISA
// choice, threads over rows.
// The ops fuse what PyTorch runs as 4-10 separate passes over memory (and as many
// dispatcher calls per layer); semantics are contbatch/ops/reference.py's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../op_checks.h"
#include "../ops.h"
#include "cpu_isa.h"
#include "layers_kernel_api.h"

namespace contbatch {
namespace {

// Rows per task: a thread is only worth waking for ~16K elements of work.
int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, row_elements)); }

template <class Fn>
void for_each_dtype(const char* op, const at::Tensor& t, Fn&& fn) {
  check_dtype_supported(op, t, /*allow_half=*/false);
  if (t.scalar_type() == at::kFloat) {
    fn(cpu::active_kernels().layers->fp32, static_cast<float*>(nullptr));
  } else {
    fn(cpu::active_kernels().layers->bf16, static_cast<uint16_t*>(nullptr));
  }
}

void check_rows(const char* op, const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
                    " must be 2-D [rows, n] with contiguous rows, got shape ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ", dtype_name(t.scalar_type()),
                   ", expected ", dtype_name(like.scalar_type()));
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
}

void check_weight(const char* op, const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), op,
                    ": weight must be contiguous [", x.size(1), "], got shape ", weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight has dtype ",
                   dtype_name(weight.scalar_type()), ", expected ", dtype_name(x.scalar_type()));
}

}  // namespace

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_rows(op, input, "input", input);
  check_rows(op, out, "out", input);
  TORCH_CHECK_VALUE(out.sizes() == input.sizes(), op, ": out has shape ", out.sizes(), ", input ", input.sizes());
  check_weight(op, weight, input);
  const int64_t rows = input.size(0), n = input.size(1);
  for_each_dtype(op, input, [&](auto* kernels, auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(input.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) kernels->rms_norm(o + r * out.stride(0), x + r * input.stride(0), w, n, eps);
    });
  });
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  constexpr const char* op = "fused_add_rms_norm";
  check_rows(op, input, "input", input);
  check_rows(op, residual, "residual", input);
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes(), op, ": residual has shape ", residual.sizes(), ", input ",
                    input.sizes());
  check_weight(op, weight, input);
  const int64_t rows = input.size(0), n = input.size(1);
  for_each_dtype(op, input, [&](auto* kernels, auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* x = static_cast<T*>(input.data_ptr());
    T* res = static_cast<T*>(residual.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        kernels->add_rms_norm(x + r * input.stride(0), res + r * residual.stride(0), w, n, eps);
      }
    });
  });
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  constexpr const char* op = "silu_and_mul";
  check_rows(op, input, "input", input);
  check_rows(op, out, "out", input);
  const int64_t rows = input.size(0), d = input.size(1) / 2;
  TORCH_CHECK_VALUE(input.size(1) % 2 == 0 && out.size(0) == rows && out.size(1) == d, op,
                    ": input must be [rows, 2 * d] and out [rows, d], got ", input.sizes(), " and ", out.sizes());
  for_each_dtype(op, input, [&](auto* kernels, auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(input.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, rows, grain_for(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) kernels->silu_and_mul(o + r * out.stride(0), x + r * input.stride(0), d);
    });
  });
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                          const at::Tensor& sin) {
  constexpr const char* op = "rotary_embedding";
  for (const auto& [t, name] : {std::pair{&query, "query"}, std::pair{&key, "key"}}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->stride(2) == 1, op, ": ", name,
                      " must be [tokens, heads, head_size] with a contiguous last dim, got ", t->sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == query.scalar_type(), op, ": key and query dtypes differ");
  }
  const int64_t tokens = query.size(0), head_size = query.size(2);
  TORCH_CHECK_VALUE(key.size(0) == tokens && key.size(2) == head_size && head_size % 2 == 0, op,
                    ": key ", key.sizes(), " does not match query ", query.sizes());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == tokens && positions.scalar_type() == at::kLong &&
                        positions.is_contiguous(),
                    op, ": positions must be contiguous int64 [", tokens, "]");
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->is_contiguous() && t->size(1) == head_size &&
                          t->scalar_type() == query.scalar_type(),
                      op, ": ", name, " must be contiguous [max_positions, ", head_size, "] in the query's dtype");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_positions, op, ": positions[", t, "] = ", pos[t],
                      " is outside the table's ", max_positions, " positions");
  }
  const int64_t q_heads = query.size(1), k_heads = key.size(1), half = head_size / 2;
  for_each_dtype(op, query, [&](auto* kernels, auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* q = static_cast<T*>(query.data_ptr());
    T* k = static_cast<T*>(key.data_ptr());
    const T* c = static_cast<const T*>(cos.data_ptr());
    const T* s = static_cast<const T*>(sin.data_ptr());
    at::parallel_for(0, tokens, grain_for((q_heads + k_heads) * head_size), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* ct = c + pos[t] * head_size;
        const T* st = s + pos[t] * head_size;
        for (int64_t h = 0; h < q_heads; ++h) kernels->rotary(q + t * query.stride(0) + h * query.stride(1), ct, st, half);
        for (int64_t h = 0; h < k_heads; ++h) kernels->rotary(k + t * key.stride(0) + h * key.stride(1), ct, st, half);
      }
    });
  });
}

void argmax_rows_cpu(at::Tensor& out, const at::Tensor& logits) {
  constexpr const char* op = "argmax_rows";
  check_rows(op, logits, "logits", logits);
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK_VALUE(n > 0, op, ": logits must have at least one column, got shape ", logits.sizes());
  TORCH_CHECK_VALUE(out.dim() == 1 && out.size(0) == rows && out.is_contiguous() && out.scalar_type() == at::kLong &&
                        out.device().is_cpu(),
                    op, ": out must be a contiguous int64 CPU tensor of shape [", rows, "], got ", out.sizes(), " ",
                    dtype_name(out.scalar_type()));
  int64_t* o = out.data_ptr<int64_t>();
  for_each_dtype(op, logits, [&](auto* kernels, auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(logits.data_ptr());
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = kernels->argmax(x + r * logits.stride(0), n);
    });
  });
}

}  // namespace contbatch
