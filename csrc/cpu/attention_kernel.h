// Paged attention for one WorkItem, written once against the Vec16 functions of
// simd_avx512.h or simd_generic.h (whichever the including file put in scope).
//
// For each chunk of up to 16 key positions (which may span cache blocks) the item:
//   1. computes the scores of all its rows (query heads x query tokens sharing one kv head),
//      so every K row is loaded from memory once for all of them;
//   2. updates each row's online softmax (running max m, running sum l) in fp32;
//   3. accumulates p * V into the rows, a few rows at a time with their accumulators in
//      registers, each V row loaded once per few rows: fp32 FMAs, or for bf16 on AVX512_BF16
//      vdpbf16ps on bf16-rounded p (two keys per instruction, fp32 sums; see simd_avx512.h).
// Layouts: attention_kernel_api.h.

constexpr int kChunk = kLanes;  // key positions per chunk: one vector of scores per row
constexpr float kLog2e = 1.44269504088896341f;
// Scores are kept in base 2 (scale * log2 e folded in) and the running max m is raised only
// when a score exceeds it by more than this: exp2(score - m) then stays below 2^8, which
// fp32 holds with room to spare, and most chunks skip the horizontal max and the rescale.
constexpr float kRescaleSlack = 8.0f;

// Rows whose accumulators stay in registers while p * V is accumulated: RB * NC of them
// plus the V row's NC must fit the 32 vector registers.
template <int NC>
constexpr int max_row_block() {
  return NC <= 5 ? 4 : NC <= 6 ? 3 : NC <= 8 ? 2 : 1;
}

template <int N>
struct RowBlock {
  static constexpr int size = N;
};

// Calls block(RowBlock<B>{}, r) for rows [0, rows): blocks of kBlock rows, then one smaller.
template <int kBlock, class F>
inline void for_row_blocks(int rows, const F& block) {
  int r = 0;
  for (; r + kBlock <= rows; r += kBlock) block(RowBlock<kBlock>{}, r);
  const int left = rows - r;
  if constexpr (kBlock > 3) {
    if (left == 3) return block(RowBlock<3>{}, r);
  }
  if constexpr (kBlock > 2) {
    if (left == 2) return block(RowBlock<2>{}, r);
  }
  if constexpr (kBlock > 1) {
    if (left == 1) return block(RowBlock<1>{}, r);
  }
}

// acc[r] = alpha[r] * acc[r] + sum_t prob[r][t] * V[t] for RB rows (row stride acc_len),
// t < n, in fp32. Each V row is loaded (and converted from bf16) once for the RB rows,
// which each keep NC independent FMA chains.
template <int NC, int RB, class T>
inline void accumulate_pv(float* acc, int acc_len, const float* alpha, const float (*prob)[kChunk],
                          const T* const* v_rows, int n) {
  Vec16 a[RB][NC] = {};
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = vmul(vload(acc + r * acc_len + 16 * c), vset1(alpha[r]));
  }
  for (int t = 0; t < n; ++t) {
    Vec16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vload(v_rows[t] + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const Vec16 p = vset1(prob[r][t]);
      for (int c = 0; c < NC; ++c) a[r][c] = vfma(p, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) vstore(acc + r * acc_len + 16 * c, a[r][c]);
  }
}

template <class T, int NC>
void attend_item(const AttentionArgs& args, const WorkItem& item, float* partials) {
  constexpr int D = 16 * NC;
  constexpr int kQueryLen = query_row_len<T, NC>();
  const int heads = item.num_heads;
  const int rows = heads * item.num_queries;

  constexpr int kAccLen = acc_row_len<T, NC>();
  alignas(64) T query[kMaxRows][kQueryLen];
  alignas(64) float acc[kMaxRows][kAccLen];
  alignas(64) float prob[kMaxRows][kChunk];
#ifdef CONTBATCH_BF16_PAIR_PV
  alignas(64) uint16_t prob_bf16[kMaxRows][kChunk];
#endif
  alignas(64) float l[kMaxRows][16];  // per-lane partial sums of the softmax denominator
  float m[kMaxRows], alpha[kMaxRows];
  int32_t row_lo[kMaxRows], row_hi[kMaxRows];  // key positions [lo, hi) of each row

  const T* q_base = static_cast<const T*>(args.query);
  for (int r = 0; r < rows; ++r) {
    const int qi = r / heads, h = r % heads;
    const T* src = q_base + (item.token_begin + qi) * args.query_token_stride +
                   (item.head_begin + h) * args.query_head_stride;
    for (int d = 0; d < kQueryLen; ++d) query[r][d] = d < D ? src[d] : T(0);
    for (int d = 0; d < kAccLen; ++d) acc[r][d] = 0.0f;
    m[r] = -INFINITY;
    vstore(l[r], vzero());
    const int32_t pos = item.pos_begin + qi;
    row_hi[r] = pos + 1;
    row_lo[r] = args.sliding_window > 0 && pos + 1 > args.sliding_window ? pos + 1 - args.sliding_window : 0;
  }

  const int32_t* table = args.block_tables + item.seq * args.block_table_stride;
  const T* k_base = static_cast<const T*>(args.key_cache) + item.kv_head * args.cache_head_stride;
  const T* v_base = static_cast<const T*>(args.value_cache) + item.kv_head * args.cache_head_stride;
  const Vec16 scale_log2 = vset1(args.scale * kLog2e);
  const T* k_rows[kChunk];
  const T* v_rows[kChunk];

  // Row offsets of the chunks kv_begin + i * kChunk, i = 0, 1, 2, ... in a ring of three:
  // the current one and the two after it, which are prefetched into L2 while the current
  // one is computed (blocks are scattered, so K/V come from DRAM without a usable stream).
  // Re-prefetching the next chunk measured faster than prefetching each chunk once.
  int64_t row_at[3][kChunk];
  int chunk_len[3] = {0, 0, 0};
  auto locate_chunk = [&](int i) {
    const int32_t c0 = item.kv_begin + i * kChunk;
    const int n = item.kv_end - c0 < kChunk ? item.kv_end - c0 : kChunk;
    int64_t block = c0 / args.block_size, offset = c0 % args.block_size;
    for (int t = 0; t < n; ++t) {
      row_at[i % 3][t] = table[block] * args.cache_block_stride + offset * D;
      if (++offset == args.block_size) {
        offset = 0;
        ++block;
      }
    }
    chunk_len[i % 3] = n;
  };
  auto prefetch_chunk = [&](int i) {
    for (int t = 0; t < chunk_len[i % 3]; ++t) {
      for (int byte = 0; byte < D * int(sizeof(T)); byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_base + row_at[i % 3][t]) + byte, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(v_base + row_at[i % 3][t]) + byte, 0, 2);
      }
    }
  };
  const int num_chunks = (item.kv_end - item.kv_begin + kChunk - 1) / kChunk;
  for (int i = 0; i < 2 && i < num_chunks; ++i) locate_chunk(i);

  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    const int32_t c0 = item.kv_begin + chunk * kChunk;
    const int n = chunk_len[chunk % 3];
    for (int t = 0; t < n; ++t) {
      k_rows[t] = k_base + row_at[chunk % 3][t];
      v_rows[t] = v_base + row_at[chunk % 3][t];
    }
    for (int t = n; t < kChunk; ++t) k_rows[t] = k_rows[0];  // scored, then masked out
    if (chunk + 2 < num_chunks) locate_chunk(chunk + 2);
    for (int i = chunk + 1; i < chunk + 3 && i < num_chunks; ++i) prefetch_chunk(i);

    for (int r = 0; r < rows; ++r) {
      const int lo = (row_lo[r] > c0 ? row_lo[r] : c0) - c0;
      const int hi = (row_hi[r] < c0 + n ? row_hi[r] : c0 + n) - c0;
      if (lo >= hi) {  // no key of this chunk is visible to the row
        vstore(prob[r], vzero());
#ifdef CONTBATCH_BF16_PAIR_PV
        round_to_bf16(vzero(), prob_bf16[r]);
#endif
        alpha[r] = 1.0f;
        continue;
      }
      const Mask16 keep = Mask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      const Vec16 s = vmask_fill(keep, vmul(qk_tile<NC>(query[r], k_rows), scale_log2), -INFINITY);
      alpha[r] = 1.0f;
      if (vgreater(s, m[r] + kRescaleSlack)) {  // always true on the row's first keys (m = -inf)
        const float chunk_max = vreduce_max(s);
        alpha[r] = std::exp2(m[r] - chunk_max);
        m[r] = chunk_max;
      }
      Vec16 p = vmaskz(keep, vexp2(vsub(s, vset1(m[r]))));
#ifdef CONTBATCH_BF16_PAIR_PV
      if constexpr (sizeof(T) == 2) p = round_to_bf16(p, prob_bf16[r]);  // l sums what p * V uses
#endif
      vstore(l[r], vfma(vload(l[r]), vset1(alpha[r]), p));
      vstore(prob[r], p);
    }

#ifdef CONTBATCH_BF16_PAIR_PV
    if constexpr (sizeof(T) == 2) {
      for_row_blocks<max_row_block<NC>()>(rows, [&](auto block, int r) {
        accumulate_pv_pairs<NC, decltype(block)::size>(acc[r], kAccLen, alpha + r, prob_bf16 + r, v_rows, n);
      });
    } else
#endif
    {
      for_row_blocks<max_row_block<NC>()>(rows, [&](auto block, int r) {
        accumulate_pv<NC, decltype(block)::size>(acc[r], kAccLen, alpha + r, prob + r, v_rows, n);
      });
    }
  }

#ifdef CONTBATCH_BF16_PAIR_PV
  if constexpr (sizeof(T) == 2) {
    for (int r = 0; r < rows; ++r) unpermute_pairs<NC>(acc[r]);
  }
#endif
  if (item.partial >= 0) {
    float* part = partials + item.partial;
    for (int r = 0; r < rows; ++r) {
      part[r] = m[r];
      part[rows + r] = vreduce_add(vload(l[r]));
      for (int d = 0; d < D; ++d) part[2 * rows + r * D + d] = acc[r][d];
    }
    return;
  }
  T* out_base = static_cast<T*>(args.out);
  for (int r = 0; r < rows; ++r) {
    const int qi = r / heads, h = r % heads;
    T* dst = out_base + (item.token_begin + qi) * args.out_token_stride + (item.head_begin + h) * args.out_head_stride;
    const Vec16 inv = vset1(1.0f / vreduce_add(vload(l[r])));
    for (int c = 0; c < NC; ++c) vstore(dst + 16 * c, vmul(vload(acc[r] + 16 * c), inv));
  }
}

template <class T>
void reduce_item_partitions(const AttentionArgs& args, const WorkItem* parts, int num_parts, const float* partials) {
  const WorkItem& item = parts[0];
  const int heads = item.num_heads;
  const int rows = heads * item.num_queries;
  const int64_t D = args.head_size;
  T* out_base = static_cast<T*>(args.out);
  for (int r = 0; r < rows; ++r) {
    float m = -INFINITY;
    for (int i = 0; i < num_parts; ++i) m = std::fmax(m, partials[parts[i].partial + r]);
    float l = 0.0f;
    for (int i = 0; i < num_parts; ++i) {
      const float* part = partials + parts[i].partial;
      l += part[rows + r] * std::exp2(part[r] - m);
    }
    const int qi = r / heads, h = r % heads;
    T* dst = out_base + (item.token_begin + qi) * args.out_token_stride + (item.head_begin + h) * args.out_head_stride;
    for (int64_t d = 0; d < D; d += 16) {
      Vec16 sum = vzero();
      for (int i = 0; i < num_parts; ++i) {
        const float* part = partials + parts[i].partial;
        if (part[r] == -INFINITY) continue;  // no visible key in this partition
        sum = vfma(vset1(std::exp2(part[r] - m) / l), vload(part + 2 * rows + r * D + d), sum);
      }
      vstore(dst + d, sum);
    }
  }
}

template <class T>
void attend_dispatch(const AttentionArgs& args, const WorkItem& item, float* partials) {
  switch (args.head_size / 16) {  // the driver checks head_size is 16, 32, ..., 256
    case 1: return attend_item<T, 1>(args, item, partials);
    case 2: return attend_item<T, 2>(args, item, partials);
    case 3: return attend_item<T, 3>(args, item, partials);
    case 4: return attend_item<T, 4>(args, item, partials);
    case 5: return attend_item<T, 5>(args, item, partials);
    case 6: return attend_item<T, 6>(args, item, partials);
    case 7: return attend_item<T, 7>(args, item, partials);
    case 8: return attend_item<T, 8>(args, item, partials);
    case 9: return attend_item<T, 9>(args, item, partials);
    case 10: return attend_item<T, 10>(args, item, partials);
    case 11: return attend_item<T, 11>(args, item, partials);
    case 12: return attend_item<T, 12>(args, item, partials);
    case 13: return attend_item<T, 13>(args, item, partials);
    case 14: return attend_item<T, 14>(args, item, partials);
    case 15: return attend_item<T, 15>(args, item, partials);
    case 16: return attend_item<T, 16>(args, item, partials);
    default: return;
  }
}

// bf16 travels as raw uint16_t bits.
void attend(const AttentionArgs& args, const WorkItem& item, float* partials) {
  if (args.bf16) {
    attend_dispatch<uint16_t>(args, item, partials);
  } else {
    attend_dispatch<float>(args, item, partials);
  }
}

void reduce_partitions(const AttentionArgs& args, const WorkItem* parts, int num_parts, const float* partials) {
  if (args.bf16) {
    reduce_item_partitions<uint16_t>(args, parts, num_parts, partials);
  } else {
    reduce_item_partitions<float>(args, parts, num_parts, partials);
  }
}

constexpr AttentionKernels kKernels{&attend, &reduce_partitions};
