// CPU driver of the sampler's draw (contbatch/ops/reference.py sample_rows): one token per row
// of logits by temperature, min-p, top-k and top-p, from the row's uniform by inverse CDF.
// PyTorch runs this as ~8 passes over a [rows, vocab] fp32 copy (copy, max, subtract, divide,
// exp, block sums, top-k); here each row is read twice by the tier's row kernels (its max,
// then its weights and their block sums into a buffer that stays in L2) and the rest works on
// a few hundred numbers: the block sums, one block, or the row's largest weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../op_checks.h"
#include "../ops.h"
#include "cpu_isa.h"
#include "layers_kernel_api.h"

namespace contbatch {
namespace {

using cpu::kSampleBlock;

// The largest weights a top-p row (without top-k) looks for its nucleus among first; a wider
// nucleus is cut by a selection by mass over the whole row.
constexpr int64_t kTopCandidates = 64;

float as_float(float x) { return x; }
float as_float(uint16_t bf16) {
  const uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

using FirstAbove = int64_t (*)(const float* x, int64_t begin, int64_t n, float bound);

struct Candidate {
  float weight;
  int64_t token;
};

// Larger weight first, the lower token id first among equal weights.
bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.weight > b.weight || (a.weight == b.weight && a.token < b.token);
}

// Index of the weight where `uniform` of the total falls: the first whose running float64 sum
// passes uniform x total. Rounding can leave that past the last positive weight: then that
// one (0 when none is positive).
template <class Weight>
int64_t inverse_cdf(const Weight& weight_at, int64_t count, double uniform) {
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) total += weight_at(i);
  const double target = uniform * total;
  double running = 0.0;
  int64_t picked = count - 1;
  for (int64_t i = 0; i < count; ++i) {
    running += weight_at(i);
    if (running > target) {
      picked = i;
      break;
    }
  }
  if (weight_at(picked) > 0) return picked;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < count; ++i) last_positive = weight_at(i) > 0 ? i : last_positive;
  return last_positive;
}

// A token with probability weight / row total, from the block sums down to one block.
int64_t draw_from_row(const float* weights, int64_t n, const float* block_sums, int64_t blocks, double uniform) {
  const auto block_sum = [&](int64_t b) { return double(block_sums[b]); };
  const int64_t block = inverse_cdf(block_sum, blocks, uniform);
  double total = 0.0, before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b == block) before = total;
    total += block_sums[b];
  }
  // Where the target falls within the block, as a fraction of the block's sum (below 1).
  const double within = std::clamp((uniform * total - before) / block_sums[block], 0.0, 1.0 - 0x1p-53);
  const float* in_block = weights + block * kSampleBlock;
  const auto weight = [&](int64_t i) { return double(in_block[i]); };
  return block * kSampleBlock + inverse_cdf(weight, std::min(kSampleBlock, n - block * kSampleBlock), within);
}

// The `count` largest positive weights, largest first (fewer if fewer are positive): a heap
// whose top is the worst kept. Most weights do not pass it: the tier's first_above skips them
// a vector at a time.
void largest_weights(const float* weights, int64_t n, int64_t count, FirstAbove first_above,
                     std::vector<Candidate>& out) {
  out.clear();
  for (int64_t i = first_above(weights, 0, n, 0.0f); i < n;) {
    if (int64_t(out.size()) < count) {
      out.push_back({weights[i], i});
    } else {  // above the worst kept (equal weights rank by token id: the earlier one stays)
      std::pop_heap(out.begin(), out.end(), ranks_before);
      out.back() = {weights[i], i};
    }
    std::push_heap(out.begin(), out.end(), ranks_before);
    const float worst = int64_t(out.size()) < count ? 0.0f : out.front().weight;  // not full: any positive enters
    i = first_above(weights, i + 1, n, worst);
  }
  std::sort_heap(out.begin(), out.end(), ranks_before);
}

// Each thread's weights of the row it samples (kept between calls: 200 KB for a 49k vocabulary,
// which a fresh allocation would fault in page by page every step), and its top-p work space.
struct RowScratch {
  std::vector<float> weights, block_sums, pool, above, below;
  std::vector<Candidate> candidates;
};

// Where top-p cuts a row: the weight at which the running sum of the row's weights, largest
// first, reaches `target`, and how many weights equal to it that takes (the lowest token ids
// of them). A selection by mass (quickselect: linear time) for rows whose nucleus is too wide
// for a heap; each round splits the weights left around a pivot into two buffers without a
// branch per weight (a branch on random weights mispredicts half the time).
struct Cut {
  float weight;
  int64_t ties;
};

Cut nucleus_cut(const float* weights, int64_t n, double target, RowScratch& scratch) {
  for (std::vector<float>* buffer : {&scratch.pool, &scratch.above, &scratch.below}) buffer->resize(n);
  float* left = scratch.pool.data();  // the weights the cut is still among
  float* above = scratch.above.data();
  float* below = scratch.below.data();
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    left[count] = weights[i];
    count += weights[i] > 0;
  }
  while (count > 0) {
    const float a = left[0], b = left[count / 2], c = left[count - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    int64_t n_above = 0, n_below = 0;
    double mass[4] = {0.0, 0.0, 0.0, 0.0};  // four sums: one would wait on each add
    for (int64_t i = 0; i < count; ++i) {
      const float w = left[i];
      above[n_above] = w;
      below[n_below] = w;
      n_above += w > pivot;
      n_below += w < pivot;
      mass[i & 3] += w > pivot ? w : 0.0f;
    }
    const double mass_above = (mass[0] + mass[1]) + (mass[2] + mass[3]);
    const int64_t n_equal = count - n_above - n_below;
    const double mass_equal = double(pivot) * double(n_equal);
    if (mass_above >= target) {
      std::swap(left, above);
      count = n_above;
    } else if (mass_above + mass_equal >= target) {
      const int64_t ties = int64_t(std::ceil((target - mass_above) / pivot));
      return {pivot, std::clamp<int64_t>(ties, 1, n_equal)};
    } else {
      target -= mass_above + mass_equal;
      std::swap(left, below);
      count = n_below;
    }
  }
  return {0.0f, 0};  // rounding: the target is the whole row's mass; every positive weight stays
}

// A token among the row's weights above the cut (and the cut's ties it takes), in token-id
// order: the weights outside the nucleus zeroed in place, then drawn as from a whole row.
int64_t draw_above_cut(float* weights, int64_t n, Cut cut, double uniform, float* block_sums) {
  int64_t last_tie = -1;
  for (int64_t i = 0, seen = 0; i < n && seen < cut.ties; ++i) {
    if (weights[i] == cut.weight) last_tie = i, ++seen;
  }
  for (int64_t i = 0; i <= last_tie; ++i) weights[i] = weights[i] >= cut.weight ? weights[i] : 0.0f;
  for (int64_t i = last_tie + 1; i < n; ++i) weights[i] = weights[i] > cut.weight ? weights[i] : 0.0f;
  const int64_t blocks = (n + kSampleBlock - 1) / kSampleBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kSampleBlock, end = std::min(n, begin + kSampleBlock);
    float sums[16] = {};  // lane-wise sums the compiler keeps in vectors
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
      for (int j = 0; j < 16; ++j) sums[j] += weights[i + j];
    }
    for (; i < end; ++i) sums[0] += weights[i];
    float total = 0.0f;
    for (float s : sums) total += s;
    block_sums[b] = total;
  }
  return draw_from_row(weights, n, block_sums, blocks, uniform);
}

// A token among the first `kept` candidates, in token-id order.
int64_t draw_from_candidates(std::vector<Candidate>& candidates, int64_t kept, double uniform) {
  std::sort(candidates.begin(), candidates.begin() + kept,
            [](const Candidate& a, const Candidate& b) { return a.token < b.token; });
  const auto weight = [&](int64_t i) { return double(candidates[i].weight); };
  return candidates[inverse_cdf(weight, kept, uniform)].token;
}

// The length of the smallest prefix of the first `count` candidates (largest first) whose
// running sum reaches `target`, or 0 if they all fall short.
int64_t prefix_reaching(const std::vector<Candidate>& candidates, int64_t count, double target) {
  double running = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    running += candidates[i].weight;
    if (running >= target) return i + 1;
  }
  return 0;
}


// A token among the row's k largest weights (all of them when top_k is 0), in the smallest
// prefix of them, largest first, whose mass reaches top_p of theirs; drawn in token-id order.
int64_t draw_from_top(float* weights, int64_t n, double row_total, int64_t top_k, double top_p, double uniform,
                      FirstAbove first_above, RowScratch& scratch) {
  std::vector<Candidate>& candidates = scratch.candidates;
  if (top_k > 0 && top_k < n) {
    largest_weights(weights, n, top_k, first_above, candidates);
    const int64_t kept = int64_t(candidates.size());
    if (top_p >= 1) return draw_from_candidates(candidates, kept, uniform);
    double mass = 0.0;
    for (const Candidate& c : candidates) mass += c.weight;
    const int64_t prefix = prefix_reaching(candidates, kept, top_p * mass);
    return draw_from_candidates(candidates, prefix > 0 ? prefix : kept, uniform);  // 0: rounding, all stay
  }
  // Top-p alone: most rows' nucleus is among their few largest weights; a wide one is cut by mass.
  largest_weights(weights, n, kTopCandidates, first_above, candidates);
  const int64_t prefix = prefix_reaching(candidates, int64_t(candidates.size()), top_p * row_total);
  if (prefix > 0) return draw_from_candidates(candidates, prefix, uniform);
  const Cut cut = nucleus_cut(weights, n, top_p * row_total, scratch);
  return draw_above_cut(weights, n, cut, uniform, scratch.block_sums.data());
}

template <class T>
int64_t sample_row(const cpu::LayerKernels<T>& kernels, FirstAbove first_above, const T* x, int64_t n,
                   float temperature, int64_t top_k, float top_p, float min_p, double uniform) {
  if (temperature == 0) {
    const int64_t token = kernels.argmax(x, n);
    return as_float(x[token]) == -INFINITY ? -1 : token;
  }
  const float top = kernels.row_max(x, n);
  if (!(top > -INFINITY) || top == INFINITY) return -1;  // every token masked out, or no number to scale by
  thread_local RowScratch scratch;
  const int64_t blocks = (n + kSampleBlock - 1) / kSampleBlock;
  scratch.weights.resize(n);
  scratch.block_sums.resize(blocks);
  // min-p keeps weights >= min_p (the maximum's weight is 1): those above the float just below it.
  const float floor = min_p > 0 ? std::nextafter(min_p, -1.0f) : -1.0f;
  kernels.tempered_weights(x, n, top, 1.4426950408889634f / temperature, floor, scratch.weights.data(),
                           scratch.block_sums.data());
  float* weights = scratch.weights.data();
  if ((top_k > 0 && top_k < n) || top_p < 1) {  // top_k >= n keeps every token: no top-k
    double row_total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) row_total += scratch.block_sums[b];
    return draw_from_top(weights, n, row_total, top_k, top_p, uniform, first_above, scratch);
  }
  return draw_from_row(weights, n, scratch.block_sums.data(), blocks, uniform);
}

void check_row_settings(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == dtype &&
                        t.device().is_cpu(),
                    op, ": ", name, " must be a contiguous ", dtype_name(dtype), " CPU tensor of shape [", rows,
                    "], got ", t.sizes(), " ", dtype_name(t.scalar_type()), " on ", t.device());
}

}  // namespace

void sample_rows_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniform) {
  constexpr const char* op = "sample_rows";
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1 && logits.device().is_cpu(), op,
                    ": logits must be 2-D [rows, vocab] CPU rows with contiguous columns, got shape ", logits.sizes(),
                    " strides ", logits.strides(), " on ", logits.device());
  check_dtype_supported(op, logits, /*allow_half=*/false);
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK_VALUE(n > 0, op, ": logits must have at least one column, got shape ", logits.sizes());
  check_row_settings(op, out, "out", at::kLong, rows);
  check_row_settings(op, temperatures, "temperatures", at::kFloat, rows);
  check_row_settings(op, top_k, "top_k", at::kLong, rows);
  check_row_settings(op, top_p, "top_p", at::kFloat, rows);
  check_row_settings(op, min_p, "min_p", at::kFloat, rows);
  check_row_settings(op, uniform, "uniform", at::kDouble, rows);
  const float* temperature = temperatures.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float* p = top_p.data_ptr<float>();
  const float* floor = min_p.data_ptr<float>();
  const double* u = uniform.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  const cpu::LayerKernelSet& kernels = *cpu::active_kernels().layers;
  const FirstAbove first_above = kernels.first_above;
  const auto run = [&](const auto& kernels, const auto* x) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        o[r] = sample_row(kernels, first_above, x + r * logits.stride(0), n, temperature[r], k[r], p[r], floor[r], u[r]);
      }
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(*kernels.fp32, static_cast<const float*>(logits.data_ptr()));
  } else {
    run(*kernels.bf16, static_cast<const uint16_t*>(logits.data_ptr()));
  }
}

}  // namespace contbatch
