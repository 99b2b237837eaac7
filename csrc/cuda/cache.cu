// CUDA reshape_and_cache and copy_blocks.
// Layouts: docs/design/kv_cache_layout.md (checked in ../op_checks.h); a slot < 0 skips the token.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../op_checks.h"

namespace contbatch {

namespace {

// One thread block per token, threads over (kv head, element).
template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int64_t num_slots,
                                         int64_t token_stride, int64_t head_stride, int num_kv_heads, int head_size,
                                         int block_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // skipped; a slot past the cache is not written either
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const int64_t src = token * token_stride + h * head_stride + d;
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_size + d;
    key_cache[dst] = key[src];
    value_cache[dst] = value[src];
  }
}

// Grid (layer, pair): copies one block of one layer's key and value cache, 16 bytes at a time.
__device__ void copy_block(int4* cache, int64_t src, int64_t dst, int64_t words_per_block) {
  for (int64_t i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    cache[dst * words_per_block + i] = cache[src * words_per_block + i];
  }
}

__global__ void copy_blocks_kernel(const int64_t* __restrict__ key_ptrs, const int64_t* __restrict__ value_ptrs,
                                   const int64_t* __restrict__ block_mapping, int64_t words_per_block) {
  const int64_t src = block_mapping[2 * blockIdx.y], dst = block_mapping[2 * blockIdx.y + 1];
  copy_block(reinterpret_cast<int4*>(key_ptrs[blockIdx.x]), src, dst, words_per_block);
  copy_block(reinterpret_cast<int4*>(value_ptrs[blockIdx.x]), src, dst, words_per_block);
}

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", dtype_name(dtype));
  }
}

}  // namespace

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, /*allow_half=*/true,
                               /*allow_int8=*/false);
  const int64_t num_tokens = key.size(0);
  if (num_tokens == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  // One layout for both inputs: the cache's dtype, contiguous rows, equal strides.
  const at::Tensor k = key.to(key_cache.scalar_type()).contiguous();
  const at::Tensor v = value.to(key_cache.scalar_type()).contiguous();
  const int num_kv_heads = k.size(1), head_size = k.size(2), block_size = key_cache.size(2);
  const int threads = std::min(num_kv_heads * head_size, 512);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(key_cache.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    reshape_and_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(
        k.data_ptr<T>(), v.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
        slot_mapping.data_ptr<int64_t>(), key_cache.size(0) * block_size, k.stride(0), k.stride(1), num_kv_heads,
        head_size, block_size);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_blocks_cuda(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                      const at::Tensor& block_mapping) {
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || key_caches.empty()) return;
  const at::Tensor& first = key_caches[0];
  const c10::cuda::OptionalCUDAGuard guard(first.device());
  if (block_mapping.is_cpu()) {  // the usual case: check its values before they reach the GPU
    const at::Tensor mapping = block_mapping.contiguous();
    check_block_mapping_values(mapping.data_ptr<int64_t>(), num_pairs, first.size(0));
  }
  const int64_t block_bytes = first.stride(0) * first.element_size();
  TORCH_CHECK_VALUE(block_bytes % sizeof(int4) == 0, "copy_blocks: a cache block of ", block_bytes,
                    " bytes is not a multiple of 16 bytes");
  // Each layer's cache address, gathered on the host and copied to the device.
  const int num_layers = static_cast<int>(key_caches.size());
  TORCH_CHECK_VALUE(num_pairs <= 65535, "copy_blocks: at most 65535 block pairs per call on CUDA, got ", num_pairs);
  at::Tensor ptrs = at::empty({2, num_layers}, at::TensorOptions().dtype(at::kLong));
  int64_t* host_ptrs = ptrs.data_ptr<int64_t>();
  for (int i = 0; i < num_layers; ++i) {
    host_ptrs[i] = reinterpret_cast<int64_t>(key_caches[i].data_ptr());
    host_ptrs[num_layers + i] = reinterpret_cast<int64_t>(value_caches[i].data_ptr());
  }
  const at::Tensor ptrs_d = ptrs.to(first.device());
  const at::Tensor mapping_d = block_mapping.to(first.device()).contiguous();
  const dim3 grid(num_layers, num_pairs);
  copy_blocks_kernel<<<grid, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ptrs_d.data_ptr<int64_t>(), ptrs_d.data_ptr<int64_t>() + num_layers, mapping_d.data_ptr<int64_t>(),
      block_bytes / static_cast<int64_t>(sizeof(int4)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace contbatch

TORCH_LIBRARY_IMPL(contbatch, CUDA, m) {
  m.impl("reshape_and_cache", &contbatch::reshape_and_cache_cuda);
  m.impl("copy_blocks", &contbatch::copy_blocks_cuda);
}
