// Paged attention for one WorkItem, written once against the Vec16 functions of
// simd_avx512.h or simd_generic.h (whichever the including file put in scope).
//
// For each chunk of up to 16 key positions (which may span cache blocks) the item:
//   1. computes the scores of all its rows (query heads x query tokens sharing one kv head),
//      so every K row is loaded from memory once for all of them;
//   2. updates each row's online softmax (running max m, running sum l) in fp32;
//   3. accumulates p * V into the rows, a few rows at a time with their accumulators in
//      registers, each V row converted to fp32 once per few rows.
// Layouts: attention_kernel_api.h.

constexpr int kChunk = 16;
constexpr float kLog2e = 1.44269504088896341f;
// Scores are kept in base 2 (scale * log2 e folded in) and the running max m is raised only
// when a score exceeds it by more than this: exp2(score - m) then stays below 2^8, which
// fp32 holds with room to spare, and most chunks skip the horizontal max and the rescale.
constexpr float kRescaleSlack = 8.0f;

// Rows whose accumulators stay in registers during accumulate_pv: RB * NC of them plus NC
// for the V row must fit the 32 vector registers.
template <int NC>
constexpr int max_row_block() {
  return NC <= 5 ? 4 : NC <= 6 ? 3 : NC <= 8 ? 2 : 1;
}

// acc[r] = alpha[r] * acc[r] + sum_t prob[r][t] * V[t] for RB rows, t < n. Each V row is
// loaded (and converted from bf16) once for the RB rows, which each keep NC independent
// FMA chains.
template <int NC, int RB, class T>
inline void accumulate_pv(float (*acc)[16 * NC], const float* alpha, const float (*prob)[kChunk],
                          const T* const* v_rows, int n) {
  Vec16 a[RB][NC] = {};
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = vload(acc[r] + 16 * c);
    if (alpha[r] != 1.0f) {
      for (int c = 0; c < NC; ++c) a[r][c] = vmul(a[r][c], vset1(alpha[r]));
    }
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
    for (int c = 0; c < NC; ++c) vstore(acc[r] + 16 * c, a[r][c]);
  }
}

template <int NC, class T>
inline void accumulate_pv_rows(float (*acc)[16 * NC], const float* alpha, const float (*prob)[kChunk],
                               const T* const* v_rows, int n, int rows) {
  constexpr int kBlock = max_row_block<NC>();
  int r = 0;
  for (; r + kBlock <= rows; r += kBlock) accumulate_pv<NC, kBlock>(acc + r, alpha + r, prob + r, v_rows, n);
  switch (rows - r) {  // at most kBlock - 1 rows left
    case 3: if constexpr (kBlock > 3) return accumulate_pv<NC, 3>(acc + r, alpha + r, prob + r, v_rows, n); break;
    case 2: if constexpr (kBlock > 2) return accumulate_pv<NC, 2>(acc + r, alpha + r, prob + r, v_rows, n); break;
    case 1: if constexpr (kBlock > 1) return accumulate_pv<NC, 1>(acc + r, alpha + r, prob + r, v_rows, n); break;
    default: break;
  }
}

template <class T, int NC>
void attend_item(const AttentionArgs& args, const WorkItem& item, float* partials) {
  constexpr int D = 16 * NC;
  constexpr int kQueryLen = query_row_len<T, NC>();
  const int heads = item.num_heads;
  const int rows = heads * item.num_queries;

  alignas(64) T query[kMaxRows][kQueryLen];
  alignas(64) float acc[kMaxRows][D];
  alignas(64) float prob[kMaxRows][kChunk];
  alignas(64) float l[kMaxRows][16];  // per-lane partial sums of the softmax denominator
  float m[kMaxRows], alpha[kMaxRows];
  int32_t row_lo[kMaxRows], row_hi[kMaxRows];  // key positions [lo, hi) of each row

  const T* q_base = static_cast<const T*>(args.query);
  for (int r = 0; r < rows; ++r) {
    const int qi = r / heads, h = r % heads;
    const T* src = q_base + (item.token_begin + qi) * args.query_token_stride +
                   (item.head_begin + h) * args.query_head_stride;
    for (int d = 0; d < kQueryLen; ++d) query[r][d] = d < D ? src[d] : T(0);
    for (int d = 0; d < D; ++d) acc[r][d] = 0.0f;
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

  // Row offsets of the current and the next chunk: the next one is prefetched while the
  // current one is computed, since blocks are scattered and K/V come from DRAM.
  int64_t row_at[2][kChunk];
  auto locate_chunk = [&](int32_t c0, int64_t* at) {
    const int n = item.kv_end - c0 < kChunk ? item.kv_end - c0 : kChunk;
    int64_t block = c0 / args.block_size, offset = c0 % args.block_size;
    for (int t = 0; t < n; ++t) {
      at[t] = table[block] * args.cache_block_stride + offset * D;
      if (++offset == args.block_size) {
        offset = 0;
        ++block;
      }
    }
    return n;
  };
  int n_next = locate_chunk(item.kv_begin, row_at[0]);

  for (int32_t c0 = item.kv_begin, chunk = 0; c0 < item.kv_end; c0 += kChunk, ++chunk) {
    const int n = n_next;
    const int64_t* at = row_at[chunk & 1];
    for (int t = 0; t < n; ++t) {
      k_rows[t] = k_base + at[t];
      v_rows[t] = v_base + at[t];
    }
    for (int t = n; t < kChunk; ++t) k_rows[t] = k_rows[0];  // scored, then masked out
    if (c0 + kChunk < item.kv_end) {
      int64_t* next_at = row_at[(chunk + 1) & 1];
      n_next = locate_chunk(c0 + kChunk, next_at);
      for (int t = 0; t < n_next; ++t) {
        for (int byte = 0; byte < D * int(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_base + next_at[t]) + byte);
          __builtin_prefetch(reinterpret_cast<const char*>(v_base + next_at[t]) + byte);
        }
      }
    }

    for (int r = 0; r < rows; ++r) {
      const int lo = (row_lo[r] > c0 ? row_lo[r] : c0) - c0;
      const int hi = (row_hi[r] < c0 + n ? row_hi[r] : c0 + n) - c0;
      if (lo >= hi) {  // no key of this chunk is visible to the row
        vstore(prob[r], vzero());
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
      const Vec16 p = vmaskz(keep, vexp2(vsub(s, vset1(m[r]))));
      vstore(l[r], vfma(vload(l[r]), vset1(alpha[r]), p));
      vstore(prob[r], p);
    }
    accumulate_pv_rows<NC>(acc, alpha, prob, v_rows, n, rows);
  }

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
