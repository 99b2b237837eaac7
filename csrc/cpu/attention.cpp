// CPU paged_attention driver: checks the batch, cuts it into WorkItems and runs them on
// ATen's thread pool with the kernels of the active ISA tier (cpu_isa.h).
//
// Work items: for each sequence, kv head and tile of query tokens, the query heads of that
// kv head (GQA) together, at most kMaxRows rows, so each K/V row is read once per tile.
// Where a tile holds whole GQA groups, one item takes up to kMaxKvHeadsPerItem kv heads, so
// it reads each cache block's kv heads as one contiguous span (a block of one kv head is
// only block_size x head_size elements, and scattered small reads leave DRAM idle).
// Decode (one query per sequence) gives one item per sequence and kv-head group. When that is too
// few items to keep every thread busy (small batch, long context), each item's key range is
// split into partitions whose partial softmax results are combined afterwards (split-K,
// like vLLM's paged_attention_v2). Threads take items, most expensive first, from a
// shared counter, so ragged batches (mixed prefill and decode) stay balanced.
// Layouts: docs/design/kv_cache_layout.md (checked in ../op_checks.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#ifdef __linux__
#include <sched.h>  // sched_getaffinity (planned_threads)
#endif

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "../op_checks.h"
#include "../ops.h"
#include "attention_kernel_api.h"
#include "cpu_isa.h"

namespace contbatch {

namespace {

using cpu::AttentionArgs;
using cpu::AttentionKernels;
using cpu::kMaxKvHeadsPerItem;
using cpu::kMaxRows;
using cpu::WorkItem;

constexpr int64_t kItemsPerThread = 4;     // fewer than this per thread: split the key ranges
constexpr int64_t kMinPartition = 256;     // key positions per partition, at least
constexpr int64_t kPartitionsPerThread = 8;

// Checks each sequence's lengths and block ids, then appends its work items.
void add_sequence_items(std::vector<WorkItem>& items, int32_t seq, int32_t q_begin, int32_t q_end,
                        int32_t seq_len, const int32_t* table, int64_t max_blocks, int64_t num_blocks,
                        int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t sliding_window) {
  const int32_t q_len = q_end - q_begin;
  TORCH_CHECK_VALUE(q_len <= seq_len, "paged_attention: sequence ", seq, " has ", q_len,
                    " query tokens but seq_lens = ", seq_len, " (seq_lens includes the query tokens)");
  const int64_t used_blocks = (seq_len + block_size - 1) / block_size;
  TORCH_CHECK_VALUE(used_blocks <= max_blocks, "paged_attention: sequence ", seq, " needs ", used_blocks,
                    " blocks for seq_len ", seq_len, " but block_tables has ", max_blocks, " columns");
  for (int64_t b = 0; b < used_blocks; ++b) {
    TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < num_blocks, "paged_attention: block_tables[", seq, "][", b,
                      "] = ", table[b], " is outside [0, ", num_blocks, ")");
  }
  const int32_t heads_per_item = static_cast<int32_t>(std::min<int64_t>(group, kMaxRows));
  const int32_t queries_per_item = kMaxRows / heads_per_item;
  // Whole GQA groups per item: its kv heads' rows of a cache block are adjacent in memory.
  const int32_t kv_heads_per_item = heads_per_item == group ? kMaxKvHeadsPerItem : 1;
  for (int32_t qi = 0; qi < q_len; qi += queries_per_item) {
    const int32_t num_queries = std::min(queries_per_item, q_len - qi);
    const int32_t pos = seq_len - q_len + qi;
    const int32_t kv_begin = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
    for (int32_t kv_head = 0; kv_head < num_kv_heads; kv_head += kv_heads_per_item) {
      const int32_t kv_heads = static_cast<int32_t>(std::min<int64_t>(kv_heads_per_item, num_kv_heads - kv_head));
      for (int32_t h = 0; h < group; h += heads_per_item) {
        const int32_t heads = static_cast<int32_t>(std::min<int64_t>(heads_per_item, group - h));
        items.push_back(WorkItem{seq, kv_head, kv_heads, static_cast<int32_t>(kv_head * group + h), heads,
                                 q_begin + qi, num_queries, pos, kv_begin, pos + num_queries, -1});
      }
    }
  }
}

// One call's work, reused across calls: no allocation per step once the batch size has been
// seen. Callers bind the thread_local instance to a reference, so that the worker threads
// use the calling thread's copy.
struct Plan {
  std::vector<WorkItem> items;  // before split-K
  std::vector<WorkItem> tasks;  // after split-K
  std::vector<int64_t> order;   // tasks, most expensive first
  std::vector<std::pair<int64_t, int64_t>> split_items;  // [begin, end) in tasks of each split item
  int64_t partial_floats = 0;   // scratch the split tasks need
};

void plan_items(Plan& plan, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t sliding_window) {
  const int64_t num_tokens = query.size(0), num_kv_heads = key_cache.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  plan.items.clear();
  TORCH_CHECK_VALUE(starts[0] == 0, "paged_attention: query_start_loc[0] must be 0, got ", starts[0]);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    TORCH_CHECK_VALUE(starts[s] <= starts[s + 1] && starts[s + 1] <= num_tokens, "paged_attention: query_start_loc[",
                      s + 1, "] = ", starts[s + 1], " is not within [", starts[s], ", num_tokens=", num_tokens, "]");
    if (starts[s] == starts[s + 1]) continue;
    add_sequence_items(plan.items, static_cast<int32_t>(s), starts[s], starts[s + 1], lens[s],
                       tables + s * block_tables.stride(0), block_tables.size(1), key_cache.size(0),
                       key_cache.size(2), num_kv_heads, query.size(1) / num_kv_heads, sliding_window);
  }
}

// Query rows an item attends, over all its kv heads.
int64_t item_rows(const WorkItem& w) { return int64_t(w.num_kv_heads) * w.num_heads * w.num_queries; }

// The threads split-K plans for: the CPUs this process may run on, not the threads running
// now. A split changes the order of a row's sums, and the engine changes the thread count
// with the machine's load (contbatch/engine/threads.py): planned for the threads of the
// moment, a greedy token could change with how busy the machine was.
int64_t planned_threads() {
  static const int64_t cpus = [] {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return static_cast<int64_t>(std::thread::hardware_concurrency());
  }();
  return std::max<int64_t>(cpus, 1);
}

// Split-K when there are too few items for the threads; the tasks of one item stay adjacent.
void split_key_ranges(Plan& plan, int64_t threads, int64_t head_size, int64_t block_size) {
  plan.tasks.clear();
  plan.split_items.clear();
  plan.partial_floats = 0;
  int64_t partition = INT32_MAX;
  if (threads > 1 && static_cast<int64_t>(plan.items.size()) < kItemsPerThread * threads) {
    int64_t total_span = 0;
    for (const WorkItem& w : plan.items) total_span += w.kv_end - w.kv_begin;
    // Partitions start on cache-block boundaries (and chunk boundaries): see VisitOrder.
    const int64_t unit = block_size % 16 == 0 ? block_size : 16;
    partition = (std::max(kMinPartition, total_span / (kPartitionsPerThread * threads)) + unit - 1) / unit * unit;
  }
  for (const WorkItem& w : plan.items) {
    if (w.kv_end - w.kv_begin <= partition) {
      plan.tasks.push_back(w);
      continue;
    }
    const int64_t begin = static_cast<int64_t>(plan.tasks.size());
    for (int64_t k = w.kv_begin; k < w.kv_end; k += partition) {
      WorkItem part = w;
      part.kv_begin = static_cast<int32_t>(k);
      part.kv_end = static_cast<int32_t>(std::min<int64_t>(w.kv_end, k + partition));
      part.partial = plan.partial_floats;
      plan.partial_floats += item_rows(w) * (head_size + 2);
      plan.tasks.push_back(part);
    }
    plan.split_items.emplace_back(begin, static_cast<int64_t>(plan.tasks.size()));
  }
}

int64_t item_cost(const WorkItem& w) { return item_rows(w) * (w.kv_end - w.kv_begin); }

void order_by_cost(Plan& plan) {
  plan.order.resize(plan.tasks.size());
  for (size_t i = 0; i < plan.order.size(); ++i) plan.order[i] = static_cast<int64_t>(i);
  std::sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) {
    const int64_t cost_a = item_cost(plan.tasks[a]), cost_b = item_cost(plan.tasks[b]);
    return cost_a > cost_b || (cost_a == cost_b && a < b);
  });
}

// Runs fn(i) for i in [0, n) on the thread pool, threads pulling indices from a shared counter.
template <class F>
void run_dynamic(int64_t n, const F& fn) {
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  });
}

}  // namespace

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             /*allow_half=*/false, /*allow_int8=*/true);
  thread_local Plan plan_storage;
  Plan& plan = plan_storage;
  plan_items(plan, query, key_cache, block_tables, seq_lens, query_start_loc, sliding_window);
  if (plan.items.empty()) return;
  split_key_ranges(plan, planned_threads(), query.size(2), key_cache.size(2));
  order_by_cost(plan);

  const AttentionArgs args{query.data_ptr(), query.stride(0), query.stride(1),
                           out.data_ptr(), out.stride(0), out.stride(1),
                           key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
                           block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                           key_cache.size(2), query.size(2), query.size(1) / key_cache.size(1),
                           static_cast<float>(scale), sliding_window,
                           query.scalar_type() == at::kBFloat16, is_int8_cache(key_cache), key_cache.stride(2)};
  const AttentionKernels* kernels = cpu::active_kernels().attention;
  at::Tensor partials;  // only split tasks need scratch
  if (plan.partial_floats > 0) partials = at::empty({plan.partial_floats}, query.options().dtype(at::kFloat));
  float* partial_data = partials.defined() ? partials.data_ptr<float>() : nullptr;
  run_dynamic(static_cast<int64_t>(plan.tasks.size()),
              [&](int64_t i) { kernels->attend(args, plan.tasks[plan.order[i]], partial_data); });
  run_dynamic(static_cast<int64_t>(plan.split_items.size()), [&](int64_t i) {
    const auto [begin, end] = plan.split_items[i];
    kernels->reduce_partitions(args, &plan.tasks[begin], static_cast<int>(end - begin), partial_data);
  });
}

}  // namespace contbatch
