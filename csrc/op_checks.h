// Argument checks shared by the CPU and CUDA implementations. They look at shapes, dtypes,
// devices and strides only; the CPU ops also check index values (slots, block ids, lengths).
// The layouts are defined in docs/design/kv_cache_layout.md; what these checks accept:
//
//   key, value:              [num_tokens, num_kv_heads, head_size], last dim contiguous
//   key_cache, value_cache:  [num_blocks, num_kv_heads, block_size, head_size], contiguous;
//                            token slot = block_id * block_size + offset_in_block
//   slot_mapping:            [num_tokens] int64, < 0 = skip the token
//   query, out:              [num_tokens, num_heads, head_size], last dim contiguous,
//                            num_heads a multiple of num_kv_heads
//   block_tables:            [>= num_seqs, max_blocks_per_seq] int32
//   seq_lens:                [num_seqs] int32, context length including this step's queries
//   query_start_loc:         [num_seqs + 1] int32, cumulative query lengths
//   block_mapping:           [n, 2] int64 (src, dst) block pairs
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/attention_kernel_api.h"

namespace contbatch {

// "torch.int64" rather than ATen's "Long": the name Python users write.
inline std::string dtype_name(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

inline void check_dtype_supported(const char* op, const at::Tensor& t, bool allow_half) {
  const auto dt = t.scalar_type();
  const bool ok = dt == at::kFloat || dt == at::kBFloat16 || (allow_half && dt == at::kHalf);
  TORCH_CHECK_TYPE(ok, op, ": dtype must be float32 or bfloat16", allow_half ? " (or float16 on GPU)" : "",
                   ", got ", dtype_name(dt));
}

inline void check_same_device(const char* op, const at::Tensor& a, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", b_name, " is on ", b.device(), " but the cache is on ",
                    a.device());
}

// An int8 cache (CPU only): rows of head_size values and a 4-byte scale (kInt8KvScaleBytes).
inline bool is_int8_cache(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

// head_size of a cache's rows: its last dim, less the scale bytes of an int8 cache.
inline int64_t cache_head_size(const at::Tensor& cache) {
  return cache.size(3) - (is_int8_cache(cache) ? cpu::kInt8KvScaleBytes : 0);
}

// The attention kernels' head sizes (and an int8 cache's, which their code quantizes).
inline void check_head_size(const char* op, int64_t head_size) {
  TORCH_CHECK_VALUE(head_size % 16 == 0 && head_size <= 256, op,
                    ": head_size must be a multiple of 16 and at most 256, got ", head_size);
}

// A cache's dtype: the model's (check_dtype_supported), or int8 where the device has kernels for it.
inline void check_cache_dtype(const char* op, const at::Tensor& cache, bool allow_half, bool allow_int8) {
  if (is_int8_cache(cache)) {
    TORCH_CHECK_TYPE(allow_int8, op, ": an int8 cache (kv_cache_dtype='int8') has CPU kernels only");
    return;
  }
  check_dtype_supported(op, cache, allow_half);
}

inline void check_cache(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4, op,
                    ": key_cache must be [num_blocks, num_kv_heads, block_size, head_size], got shape ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), op, ": value_cache shape ", value_cache.sizes(),
                    " differs from key_cache shape ", key_cache.sizes());
  TORCH_CHECK_TYPE(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache dtype ",
                   dtype_name(value_cache.scalar_type()), " differs from key_cache dtype ",
                   dtype_name(key_cache.scalar_type()));
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
                    ": key_cache and value_cache must be contiguous");
  check_same_device(op, key_cache, value_cache, "value_cache");
}

inline void check_int_vector(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), op, ": ", name,
                    " must be a contiguous 1-D tensor, got shape ", t.sizes());
}

inline void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                         const at::Tensor& slot_mapping, bool allow_half, bool allow_int8) {
  constexpr const char* op = "reshape_and_cache";
  check_cache(op, key_cache, value_cache);
  check_cache_dtype(op, key_cache, allow_half, allow_int8);
  const int64_t head_size = cache_head_size(key_cache);
  if (is_int8_cache(key_cache)) {  // quantized from the input rows as they are
    check_dtype_supported(op, key, allow_half);
    TORCH_CHECK_TYPE(value.scalar_type() == key.scalar_type(), op, ": value dtype ", dtype_name(value.scalar_type()),
                     " differs from key dtype ", dtype_name(key.scalar_type()));
  }
  TORCH_CHECK_VALUE(key.dim() == 3 && key.size(1) == key_cache.size(1) && key.size(2) == head_size, op,
                    ": key must be [num_tokens, num_kv_heads=", key_cache.size(1), ", head_size=", head_size,
                    "], got shape ", key.sizes());
  if (is_int8_cache(key_cache)) check_head_size(op, head_size);  // the int8 kernels' code quantizes its rows
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), op, ": value shape ", value.sizes(), " differs from key shape ",
                    key.sizes());
  check_int_vector(op, slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), op, ": slot_mapping has ", slot_mapping.size(0),
                    " entries for ", key.size(0), " tokens");
  check_same_device(op, key_cache, key, "key");
  check_same_device(op, key_cache, value, "value");
  check_same_device(op, key_cache, slot_mapping, "slot_mapping");
}

inline void check_paged_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                       bool allow_half, bool allow_int8) {
  constexpr const char* op = "paged_attention";
  check_cache(op, key_cache, value_cache);
  TORCH_CHECK_VALUE(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got shape ",
                    query.sizes());
  check_dtype_supported(op, query, allow_half);
  check_cache_dtype(op, key_cache, allow_half, allow_int8);
  TORCH_CHECK_TYPE(is_int8_cache(key_cache) || key_cache.scalar_type() == query.scalar_type(), op, ": cache dtype ",
                   dtype_name(key_cache.scalar_type()), " differs from query dtype ", dtype_name(query.scalar_type()));
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(), op,
                    ": out must have the query's shape ", query.sizes(), " and dtype ", dtype_name(query.scalar_type()),
                    ", got ", out.sizes(), " ", dtype_name(out.scalar_type()));
  TORCH_CHECK_VALUE(query.stride(2) == 1 && out.stride(2) == 1, op,
                    ": query and out must be contiguous in the head_size dimension");
  const int64_t head_size = query.size(2);
  TORCH_CHECK_VALUE(cache_head_size(key_cache) == head_size, op, ": cache head_size ", cache_head_size(key_cache),
                    " differs from query head_size ", head_size,
                    is_int8_cache(key_cache) ? " (an int8 cache's rows hold head_size values and a 4-byte scale)" : "");
  check_head_size(op, head_size);
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(1) == 0, op, ": num_heads ", query.size(1),
                    " is not a multiple of num_kv_heads ", key_cache.size(1));
  TORCH_CHECK_TYPE(block_tables.scalar_type() == at::kInt, op, ": block_tables must be torch.int32, got ",
                   dtype_name(block_tables.scalar_type()));
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.stride(1) == 1, op,
                    ": block_tables must be [num_seqs, max_blocks_per_seq] with contiguous rows, got shape ",
                    block_tables.sizes());
  check_int_vector(op, seq_lens, "seq_lens", at::kInt);
  check_int_vector(op, query_start_loc, "query_start_loc", at::kInt);
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1, op, ": query_start_loc has ",
                    query_start_loc.size(0), " entries for ", seq_lens.size(0), " sequences (needs num_seqs + 1)");
  TORCH_CHECK_VALUE(block_tables.size(0) >= seq_lens.size(0), op, ": block_tables has ", block_tables.size(0),
                    " rows for ", seq_lens.size(0), " sequences");
  check_same_device(op, key_cache, query, "query");
  check_same_device(op, key_cache, out, "out");
  check_same_device(op, key_cache, block_tables, "block_tables");
  check_same_device(op, key_cache, seq_lens, "seq_lens");
  check_same_device(op, key_cache, query_start_loc, "query_start_loc");
}

inline void check_copy_blocks_args(const std::vector<at::Tensor>& key_caches,
                                   const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  constexpr const char* op = "copy_blocks";
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), op, ": ", key_caches.size(), " key caches but ",
                    value_caches.size(), " value caches");
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_cache(op, key_caches[i], value_caches[i]);
    check_same_device(op, key_caches[i], key_caches[0], "every layer's cache");
    TORCH_CHECK_VALUE(key_caches[i].sizes() == key_caches[0].sizes() &&
                          key_caches[i].scalar_type() == key_caches[0].scalar_type(),
                      op, ": layer ", i, "'s cache ", key_caches[i].sizes(), " ",
                      dtype_name(key_caches[i].scalar_type()), " differs from layer 0's ", key_caches[0].sizes(), " ",
                      dtype_name(key_caches[0].scalar_type()));
  }
  TORCH_CHECK_TYPE(block_mapping.scalar_type() == at::kLong, op, ": block_mapping must be torch.int64, got ",
                   dtype_name(block_mapping.scalar_type()));
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2, op,
                    ": block_mapping must be [n, 2] (src, dst), got shape ", block_mapping.sizes());
}

// Values of a host block_mapping [n, 2]: every id in [0, num_blocks), and no destination
// repeated or also a source, since the copies run in parallel.
inline void check_block_mapping_values(const int64_t* pairs, int64_t num_pairs, int64_t num_blocks) {
  constexpr const char* op = "copy_blocks";
  for (int64_t i = 0; i < 2 * num_pairs; ++i) {
    TORCH_CHECK_VALUE(pairs[i] >= 0 && pairs[i] < num_blocks, op, ": block id ", pairs[i],
                      " in block_mapping is outside [0, ", num_blocks, ")");
  }
  std::vector<int64_t> sources(num_pairs), destinations(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    sources[i] = pairs[2 * i];
    destinations[i] = pairs[2 * i + 1];
  }
  std::sort(sources.begin(), sources.end());
  std::sort(destinations.begin(), destinations.end());
  TORCH_CHECK_VALUE(std::adjacent_find(destinations.begin(), destinations.end()) == destinations.end(), op,
                    ": a destination block appears twice in block_mapping");
  for (int64_t dst : destinations) {
    TORCH_CHECK_VALUE(!std::binary_search(sources.begin(), sources.end(), dst), op, ": block ", dst,
                      " is both a source and a destination in block_mapping");
  }
}

}  // namespace contbatch
