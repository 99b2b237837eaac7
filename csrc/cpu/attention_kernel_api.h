// Interface between the ATen driver (attention.cpp) and the per-ISA attention kernels
// (kernels_<tier>.cpp, see kernel_set.h). No ATen here: the kernel translation
// units are compiled with other target ISAs and must not share inline code with the rest.
//
// Layouts: docs/design/kv_cache_layout.md (query and out with any token/head strides, given below).
#pragma once

#include <cstdint>

namespace contbatch::cpu {

// An int8 cache row (one token of one kv head) holds head_size signed values q, then the
// fp32 scale s (native byte order) of the row: the row stands for q * s, s = max|x| / 127
// (docs/design/kv_cache_layout.md).
constexpr int64_t kInt8KvScaleBytes = 4;

struct AttentionArgs {
  const void* query;
  int64_t query_token_stride;  // strides in elements
  int64_t query_head_stride;
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t cache_block_stride;
  int64_t cache_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int64_t block_size;
  int64_t head_size;        // a multiple of 16, at most 256
  int64_t heads_per_kv_head;  // query heads sharing one kv head (GQA group)
  float scale;
  int64_t sliding_window;  // <= 0: none
  bool bf16;               // element type of query and out (and of the caches unless int8): bf16 if true, else fp32
  bool int8_cache;         // caches in 8-bit rows (kInt8KvScaleBytes); else the query's type
  int64_t cache_row_stride;  // elements (bytes for int8) from one token's row of a kv head to the next
};

// Query rows and key positions one task attends. For each of its kv heads kv_head + g
// (g < num_kv_heads), its rows are r = q * num_heads + h for the query tokens
// token_begin + q (q < num_queries, at positions pos_begin + q) and the query heads
// head_begin + g * heads_per_kv_head + h (h < num_heads). An item with more than one kv head
// covers whole GQA groups (num_heads == heads_per_kv_head): it reads each cache block's kv
// heads together, one contiguous span instead of several scattered ones.
struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t num_kv_heads;
  int32_t head_begin;
  int32_t num_heads;
  int32_t token_begin;
  int32_t num_queries;
  int32_t pos_begin;
  int32_t kv_begin;  // key positions [kv_begin, kv_end)
  int32_t kv_end;
  // -1: normalise and write `out`. Else offset (in floats) of this item's partial result
  // (split-K): per kv head, m[rows] (running max, base 2), l[rows], acc[rows][head_size],
  // combined by reduce_partitions.
  int64_t partial;
};

constexpr int kMaxRows = 16;        // rows of one WorkItem per kv head: num_heads * num_queries
constexpr int kMaxKvHeadsPerItem = 4;  // kv heads of one WorkItem

struct AttentionKernels {
  void (*attend)(const AttentionArgs& args, const WorkItem& item, float* partials);
  // Combines the partial results of `num_parts` items that split one item's key range.
  void (*reduce_partitions)(const AttentionArgs& args, const WorkItem* parts, int num_parts,
                            const float* partials);
};

}  // namespace contbatch::cpu
