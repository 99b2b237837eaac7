// CUDA paged_attention: causal varlen attention over the paged cache, fp32 accumulation.
// Layouts: docs/design/kv_cache_layout.md (checked in ../op_checks.h).
// One thread block per (query token, query head): decode is one block per (sequence, head).
// Its warps take keys round-robin; a warp scores one key at a time (lanes split head_size,
// a shuffle reduction sums), keeps an online softmax (running max m, sum l, acc[head_size]
// in registers), and the warps' partial results are merged through shared memory.
// Unlike the CPU ops, these do not read index tensors on the host to check their values.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "../op_checks.h"

namespace contbatch {

namespace {

constexpr int kWarps = 4;
constexpr float kLog2e = 1.44269504088896341f;

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// kVecs = ceil(head_size / 32): the elements lane + 32 * j, j < kVecs, of each row.
template <typename T, int kVecs>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                           const T* __restrict__ value_cache, const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ query_start_loc,
                           int num_seqs, int64_t query_token_stride, int64_t query_head_stride,
                           int64_t out_token_stride, int64_t out_head_stride, int64_t block_table_stride,
                           int num_kv_heads, int group, int block_size, int head_size, float scale_log2,
                           int sliding_window) {
  const int token = blockIdx.x, head = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  int lo = 0, hi = num_seqs;  // the sequence s with query_start_loc[s] <= token < query_start_loc[s + 1]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (query_start_loc[mid + 1] <= token) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == num_seqs) return;  // a token past the batch's queries
  const int seq = lo;
  const int q_begin = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_begin;
  const int pos = seq_lens[seq] - q_len + (token - q_begin);
  const int kv_begin = sliding_window > 0 ? max(0, pos - sliding_window + 1) : 0;
  const int kv_end = pos + 1;
  const int kv_head = head / group;
  const int32_t* table = block_tables + seq * block_table_stride;

  float q[kVecs], acc[kVecs];
  const T* q_row = query + token * query_token_stride + head * query_head_stride;
  for (int j = 0; j < kVecs; ++j) {
    const int d = lane + 32 * j;
    q[j] = d < head_size ? static_cast<float>(q_row[d]) * scale_log2 : 0.0f;  // scores in base 2
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int k = kv_begin + warp; k < kv_end; k += kWarps) {
    const int64_t row = ((static_cast<int64_t>(table[k / block_size]) * num_kv_heads + kv_head) * block_size +
                         k % block_size) * head_size;
    float s = 0.0f;
    for (int j = 0; j < kVecs; ++j) {
      const int d = lane + 32 * j;
      if (d < head_size) s += q[j] * static_cast<float>(key_cache[row + d]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float alpha = exp2f(m - m_new), p = exp2f(s - m_new);
    l = l * alpha + p;
    for (int j = 0; j < kVecs; ++j) {
      const int d = lane + 32 * j;
      const float v = d < head_size ? static_cast<float>(value_cache[row + d]) : 0.0f;
      acc[j] = acc[j] * alpha + p * v;
    }
    m = m_new;
  }

  __shared__ float warp_m[kWarps], warp_l[kWarps];
  __shared__ float warp_acc[kWarps][kVecs * 32];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  for (int j = 0; j < kVecs; ++j) warp_acc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float l_all = 0.0f, weight[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = exp2f(warp_m[w] - m_all);  // 0 for a warp that saw no key
    l_all += warp_l[w] * weight[w];
  }
  T* out_row = out + token * out_token_stride + head * out_head_stride;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w) o += warp_acc[w][d] * weight[w];
    out_row[d] = static_cast<T>(o / l_all);
  }
}

template <typename T, int kVecs>
void launch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
            float scale, int sliding_window) {
  const dim3 grid(query.size(0), query.size(1));
  paged_attention_kernel<T, kVecs><<<grid, kWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      out.data_ptr<T>(), query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
      block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      static_cast<int>(seq_lens.size(0)), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      block_tables.stride(0), static_cast<int>(key_cache.size(1)),
      static_cast<int>(query.size(1) / key_cache.size(1)), static_cast<int>(key_cache.size(2)),
      static_cast<int>(query.size(2)), scale * kLog2e, sliding_window);
}

template <typename T>
void launch_for_head_size(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, float scale, int sliding_window) {
  switch ((query.size(2) + 31) / 32) {  // head_size <= 256, checked
#define CONTBATCH_CASE(vecs)                                                                               \
  case vecs:                                                                                                \
    return launch<T, vecs>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, \
                           sliding_window);
    CONTBATCH_CASE(1)
    CONTBATCH_CASE(2)
    CONTBATCH_CASE(3)
    CONTBATCH_CASE(4)
    CONTBATCH_CASE(5)
    CONTBATCH_CASE(6)
    CONTBATCH_CASE(7)
    CONTBATCH_CASE(8)
#undef CONTBATCH_CASE
  }
}

}  // namespace

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             /*allow_half=*/true, /*allow_int8=*/false);
  if (query.size(0) == 0 || seq_lens.size(0) == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  const float s = static_cast<float>(scale);
  const int window = static_cast<int>(sliding_window);
  switch (query.scalar_type()) {
    case at::kFloat:
      launch_for_head_size<float>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, s,
                                  window);
      break;
    case at::kHalf:
      launch_for_head_size<at::Half>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     s, window);
      break;
    default:
      launch_for_head_size<at::BFloat16>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, s, window);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace contbatch

TORCH_LIBRARY_IMPL(contbatch, CUDA, m) { m.impl("paged_attention", &contbatch::paged_attention_cuda); }
