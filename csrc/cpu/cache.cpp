// CPU reshape_and_cache and copy_blocks: row and block copies into the paged cache (rows
// quantized on the way into an int8 cache).
// Layouts: docs/design/kv_cache_layout.md (checked in ../op_checks.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../op_checks.h"
#include "../ops.h"
#include "int8_kernel_api.h"

namespace contbatch {

namespace {
constexpr int64_t kBytesPerTask = 1 << 16;  // below this a thread is not worth waking
}  // namespace

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, /*allow_half=*/false,
                               /*allow_int8=*/true);
  const bool int8_cache = is_int8_cache(key_cache);
  // Rows are copied whole, contiguous and in the cache's dtype, or quantized as they are.
  auto as_rows = [&](const at::Tensor& t) {
    at::Tensor rows = int8_cache ? t : t.to(key_cache.scalar_type());
    return rows.stride(2) == 1 ? rows : rows.contiguous();
  };
  const at::Tensor k = as_rows(key), v = as_rows(value);

  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_size = k.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", slots[t],
                      " is past the cache's ", num_slots, " slots");
  }

  const int64_t elem = k.element_size();
  const int64_t src_row_bytes = head_size * elem;
  const int64_t row_bytes = key_cache.size(3) * key_cache.element_size();
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  auto* k_dst = static_cast<char*>(key_cache.data_ptr());
  auto* v_dst = static_cast<char*>(value_cache.data_ptr());
  const bool bf16_rows = k.scalar_type() == at::kBFloat16;
  const cpu::Int8Kernels* int8_kernels = int8_cache ? &active_int8_kernels() : nullptr;  // int8 caches only
  const auto write_row = [&](char* dst, const char* src) {
    if (int8_cache && bf16_rows) {
      int8_kernels->bf16->quantize_kv_row(reinterpret_cast<const uint16_t*>(src), head_size,
                                          reinterpret_cast<int8_t*>(dst));
    } else if (int8_cache) {
      int8_kernels->fp32->quantize_kv_row(reinterpret_cast<const float*>(src), head_size,
                                          reinterpret_cast<int8_t*>(dst));
    } else {
      std::memcpy(dst, src, src_row_bytes);
    }
  };
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (2 * num_kv_heads * src_row_bytes));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row_bytes;
        write_row(k_dst + dst, k_src + (t * k.stride(0) + h * k.stride(1)) * elem);
        write_row(v_dst + dst, v_src + (t * v.stride(0) + h * v.stride(1)) * elem);
      }
    }
  });
}

void copy_blocks_cpu(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                     const at::Tensor& block_mapping) {
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || key_caches.empty()) return;
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();

  check_block_mapping_values(pairs, num_pairs, key_caches[0].size(0));

  std::vector<char*> bases;  // every layer's key cache, then value cache
  for (size_t i = 0; i < key_caches.size(); ++i) {
    bases.push_back(static_cast<char*>(key_caches[i].data_ptr()));
    bases.push_back(static_cast<char*>(value_caches[i].data_ptr()));
  }
  const int64_t num_copies = static_cast<int64_t>(bases.size()) * num_pairs;
  const int64_t block_bytes = key_caches[0].stride(0) * key_caches[0].element_size();
  at::parallel_for(0, num_copies, std::max<int64_t>(1, kBytesPerTask / block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* pair = pairs + 2 * (i % num_pairs);
      char* base = bases[i / num_pairs];
      std::memcpy(base + pair[1] * block_bytes, base + pair[0] * block_bytes, block_bytes);
    }
  });
}

}  // namespace contbatch
