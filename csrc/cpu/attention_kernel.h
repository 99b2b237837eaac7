// Paged attention for one WorkItem, written once against the Vec16 functions of the ISA
// tier's simd header (simd_generic.h, simd_avx2.h or simd_avx512.h), whichever
// kernel_tier.h's includer put in scope.
//
// For each chunk of up to 16 key positions (which may span cache blocks) the item:
//   1. computes the scores of all its rows (query heads x query tokens sharing one kv head),
//      so every K row is loaded from memory once for all of them;
//   2. updates each row's online softmax (running max m, running sum l) in fp32;
//   3. accumulates p * V into the rows, a few rows at a time with their accumulators in
//      registers, each V row loaded once per few rows: fp32 FMAs, or for bf16 on the
//      AVX512_BF16 tier vdpbf16ps on bf16-rounded p (two keys per instruction, fp32 sums;
//      see simd_avx512.h).
// A bf16 item of many rows over a bf16 cache on the AVX512_BF16 tier (a prefill chunk) runs
// the same steps with its rows in vector lanes instead (attend_item_by_lanes).
// Layouts: docs/design/kv_cache_layout.md (the arguments: attention_kernel_api.h).

constexpr int kChunk = kLanes;  // key positions per chunk: one vector of scores per row
constexpr float kLog2e = 1.44269504088896341f;
// Scores are kept in base 2 (scale * log2 e folded in) and the running max m is raised only
// when a score exceeds it by more than this: exp2(score - m) then stays below 2^8, which
// fp32 holds with room to spare, and most chunks skip the horizontal max and the rescale.
constexpr float kRescaleSlack = 8.0f;

// Rows whose accumulators stay in registers while p * V is accumulated: RB * NC of them,
// the V row's NC and a few temporaries must fit the tier's vector registers; at most 4.
template <int NC>
constexpr int max_row_block() {
  constexpr int rows = (kVectorRegisters - 4) / NC - 1;
  return rows < 1 ? 1 : rows > 4 ? 4 : rows;
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

// The rows of one work item, on the stack: row r is query token r / heads, head r % heads.
template <class T, int NC>
struct Rows {
  static constexpr int kD = 16 * NC;
  static constexpr int kQueryLen = query_row_len<T, NC>();
  static constexpr int kAccLen = acc_row_len<T, NC>();
  int count;
  alignas(64) T query[kMaxRows][kQueryLen];
  alignas(64) float acc[kMaxRows][kAccLen];  // sum of p * V
  alignas(64) float prob[kMaxRows][kChunk];  // p of the current chunk
#ifdef CONTBATCH_BF16_PAIR_PV
  alignas(64) uint16_t prob_bf16[kMaxRows][kChunk];
#endif
  alignas(64) float l[kMaxRows][kLanes];  // per-lane partial sums of the softmax denominator
  float m[kMaxRows];                      // running max of the base-2 scores
  float alpha[kMaxRows];                  // this chunk's rescale of acc and l
  int32_t lo[kMaxRows], hi[kMaxRows];     // visible key positions [lo, hi)
};

// T: the query's element type; W: the rows', T or fp32 (kWidenBf16Rows).
template <class T, class W, int NC>
void load_rows(Rows<W, NC>& rows, const AttentionArgs& args, const WorkItem& item) {
  rows.count = item.num_heads * item.num_queries;
  const T* q_base = static_cast<const T*>(args.query);
  for (int r = 0; r < rows.count; ++r) {
    const int qi = r / item.num_heads, h = r % item.num_heads;
    const T* src = q_base + (item.token_begin + qi) * args.query_token_stride +
                   (item.head_begin + h) * args.query_head_stride;
    if constexpr (std::is_same_v<T, W>) {
      for (int d = 0; d < rows.kQueryLen; ++d) rows.query[r][d] = d < rows.kD ? src[d] : T(0);
    } else {
      for (int d = 0; d < rows.kD; d += kLanes) vstore(rows.query[r] + d, vload(src + d));
    }
    for (int d = 0; d < rows.kAccLen; ++d) rows.acc[r][d] = 0.0f;
    vstore(rows.l[r], vzero());
    rows.m[r] = -INFINITY;
    const int32_t pos = item.pos_begin + qi;
    rows.hi[r] = pos + 1;
    rows.lo[r] = args.sliding_window > 0 && pos + 1 > args.sliding_window ? pos + 1 - args.sliding_window : 0;
  }
}

// Scores the chunk's n keys (at positions c0..) for every row and updates the row's online
// softmax, leaving the chunk's probabilities in rows.prob (and rows.prob_bf16). scale_log2:
// each key's score factor (lane t: key c0 + t). value_scales (an int8 cache's V row scales,
// else null) multiply the probabilities that weigh the V rows, not those the softmax sums.
template <class T, int NC>
void softmax_chunk(Rows<T, NC>& rows, const T* const* k_rows, int32_t c0, int n, Vec16 scale_log2,
                   const float* value_scales) {
  const int count = rows.count;  // a local: the vector stores below may alias any member
  for (int r = 0; r < count; ++r) {
    const int lo = (rows.lo[r] > c0 ? rows.lo[r] : c0) - c0;
    const int hi = (rows.hi[r] < c0 + n ? rows.hi[r] : c0 + n) - c0;
    Vec16 p = vzero();
    rows.alpha[r] = 1.0f;
    if (lo < hi) {  // else no key of this chunk is visible to the row
      const Mask16 keep = Mask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      const Vec16 s = vmask_fill(keep, vmul(qk_tile<NC>(rows.query[r], k_rows), scale_log2), -INFINITY);
      if (vgreater(s, rows.m[r] + kRescaleSlack)) {  // always true on the row's first keys (m = -inf)
        const float chunk_max = vreduce_max(s);
        rows.alpha[r] = std::exp2(rows.m[r] - chunk_max);
        rows.m[r] = chunk_max;
      }
      p = vmaskz(keep, vexp2(vsub(s, vset1(rows.m[r]))));
    }
#ifdef CONTBATCH_BF16_PAIR_PV
    if constexpr (sizeof(T) == 2) {
      if (value_scales == nullptr) {
        p = round_to_bf16(p, rows.prob_bf16[r]);  // l sums what p * V uses
      } else {
        round_to_bf16(vmul(p, vload(value_scales)), rows.prob_bf16[r]);
      }
    }
#endif
    vstore(rows.l[r], vfma(vload(rows.l[r]), vset1(rows.alpha[r]), p));
    vstore(rows.prob[r], value_scales == nullptr ? p : vmul(p, vload(value_scales)));
  }
}

template <class T, int NC>
void accumulate_chunk(Rows<T, NC>& rows, const T* const* v_rows, int n) {
#ifdef CONTBATCH_BF16_PAIR_PV
  if constexpr (sizeof(T) == 2) {
    for_row_blocks<max_row_block<NC>()>(rows.count, [&](auto block, int r) {
      const auto pair_of = [&prob = rows.prob_bf16, r](int i, int t) {
        int32_t pair;
        std::memcpy(&pair, &prob[r + i][t], sizeof pair);
        return pair;
      };
      accumulate_pv_pairs<NC, decltype(block)::size>(rows.acc[r], rows.kAccLen, rows.alpha + r, pair_of, v_rows, n);
    });
    return;
  }
#endif
  for_row_blocks<max_row_block<NC>()>(rows.count, [&](auto block, int r) {
    accumulate_pv<NC, decltype(block)::size>(rows.acc[r], rows.kAccLen, rows.alpha + r, rows.prob + r, v_rows, n);
  });
}

// Writes the rows to `out` (of element type T), normalised, or their partial results (m, l,
// acc) to `partials`.
template <class T, class W, int NC>
void store_rows(Rows<W, NC>& rows, const AttentionArgs& args, const WorkItem& item, float* partials) {
#ifdef CONTBATCH_BF16_PAIR_PV
  if constexpr (sizeof(W) == 2) {
    for (int r = 0; r < rows.count; ++r) unpermute_pairs<NC>(rows.acc[r]);
  }
#endif
  constexpr int D = Rows<W, NC>::kD;
  if (item.partial >= 0) {
    float* part = partials + item.partial;
    for (int r = 0; r < rows.count; ++r) {
      part[r] = rows.m[r];
      part[rows.count + r] = vreduce_add(vload(rows.l[r]));
      for (int d = 0; d < D; ++d) part[2 * rows.count + r * D + d] = rows.acc[r][d];
    }
    return;
  }
  T* out_base = static_cast<T*>(args.out);
  for (int r = 0; r < rows.count; ++r) {
    const int qi = r / item.num_heads, h = r % item.num_heads;
    T* dst = out_base + (item.token_begin + qi) * args.out_token_stride + (item.head_begin + h) * args.out_head_stride;
    const Vec16 inv = vset1(1.0f / vreduce_add(vload(rows.l[r])));
    for (int c = 0; c < NC; ++c) vstore(dst + 16 * c, vmul(vload(rows.acc[r] + 16 * c), inv));
  }
}

// The part of `item` that reads its kv head kv_head + g, as a single-kv-head item.
inline WorkItem kv_head_slice(const AttentionArgs& args, const WorkItem& item, int g) {
  WorkItem slice = item;
  slice.kv_head = item.kv_head + g;
  slice.num_kv_heads = 1;
  slice.head_begin = item.head_begin + g * static_cast<int32_t>(args.heads_per_kv_head);
  if (item.partial >= 0) slice.partial += g * int64_t(item.num_heads) * item.num_queries * (args.head_size + 2);
  return slice;
}

// The order in which an item visits (chunk, kv head) pairs, chunk i holding key positions
// from kv_begin + i * kChunk: a run of chunks (a cache block's worth) for its first kv head,
// the same run for the next kv head, and so on, then the next run. A cache block stores its
// kv heads one after another, so where the key range starts on a block boundary (the
// driver aligns split partitions to blocks) this reads each block in address order, one
// contiguous stream however large the block.
struct VisitOrder {
  int num_chunks;
  int kv_heads;
  int run;  // chunks per run: those of one cache block, or 1 when a chunk spans blocks

  VisitOrder(const AttentionArgs& args, const WorkItem& item)
      : num_chunks((item.kv_end - item.kv_begin + kChunk - 1) / kChunk),
        kv_heads(item.num_kv_heads),
        run(args.block_size % kChunk == 0 ? static_cast<int>(args.block_size / kChunk) : 1) {}

  int size() const { return num_chunks * kv_heads; }

  // Visit p as (chunk, kv head): every run but the last has run * kv_heads visits.
  void at(int p, int& chunk, int& head) const {
    const int r = p / (run * kv_heads);
    const int begin = r * run;
    const int length = num_chunks - begin < run ? num_chunks - begin : run;
    const int within = p - r * run * kv_heads;
    head = within / length;
    chunk = begin + within % length;
  }
};

// Where the K/V rows of an item's visits are: the cache offsets of the current visit's rows.
// T is the cache's element type (int8_t for an int8 cache, whose rows are longer than D).
template <class T, int D>
struct VisitRows {
  const AttentionArgs& args;
  const WorkItem& item;
  const VisitOrder order;
  const int32_t* table;
  const T* k_base;  // kv head item.kv_head of block 0
  const T* v_base;
  int64_t offsets[kChunk];
  int length = 0;     // rows of the visit
  int32_t start = 0;  // key position of its first row
  int head = 0;       // its kv head, relative to item.kv_head

  VisitRows(const AttentionArgs& args, const WorkItem& item)
      : args(args),
        item(item),
        order(args, item),
        table(args.block_tables + item.seq * args.block_table_stride),
        k_base(static_cast<const T*>(args.key_cache) + item.kv_head * args.cache_head_stride),
        v_base(static_cast<const T*>(args.value_cache) + item.kv_head * args.cache_head_stride) {}

  void locate(int p) {
    int chunk;
    order.at(p, chunk, head);
    start = item.kv_begin + chunk * kChunk;
    length = item.kv_end - start < kChunk ? item.kv_end - start : kChunk;
    const int64_t block_size = args.block_size, block_stride = args.cache_block_stride;
    const int64_t head_offset = head * args.cache_head_stride, row_stride = args.cache_row_stride;
    int64_t block = start / block_size, offset = start % block_size;
    for (int t = 0; t < length; ++t) {
      offsets[t] = table[block] * block_stride + head_offset + offset * row_stride;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
  }

  // The visit's K and V rows, padding K to kChunk rows with row 0 (scored, then masked out).
  void rows(const T** k_rows, const T** v_rows) const {
    for (int t = 0; t < length; ++t) {
      k_rows[t] = k_base + offsets[t];
      v_rows[t] = v_base + offsets[t];
    }
    for (int t = length; t < kChunk; ++t) k_rows[t] = k_rows[0];
  }
};

// K and V loaded ahead of an item's visits: at least this many bytes of them (one cache
// block at least) past the block being read.
constexpr int64_t kLoadAheadBytes = 48 * 1024;

// Loads an item's cache blocks into the CPU caches ahead of its visits: plain loads, one word
// of each 64-byte line, a window of blocks at a time. Decode attention reads each K/V row once,
// from DRAM, and computes little on it. On Zen 5 (2026-11-26) the kernel read 17-22 GB/s with
// software prefetches ahead (2 to 12 visits, or whole blocks up to 4 ahead) or with none at
// all; a plain loop over the same blocks read 40-75 GB/s, and with this window of independent
// loads the kernel read 30-38 (docs/design/experiments.md).
// A tier whose kernel over widened rows is bound by its arithmetic skips it for those
// (kLoadAheadOfWidenedRows: AVX2).
template <class T, int D>
struct BlockLoader {
  const char* k_base;  // kv head item.kv_head of block 0
  const char* v_base;
  const int32_t* table;
  int64_t block_stride_bytes;
  int64_t span_bytes;  // of the item's kv heads in one block, in K (and in V)
  int64_t window;      // blocks loaded ahead, at least
  int64_t next;        // first block not loaded yet
  int64_t end;         // one past the item's last block

  // The blocks of the item whose rows `visit` locates, from the same bases and block table.
  explicit BlockLoader(const VisitRows<T, D>& visit)
      : k_base(reinterpret_cast<const char*>(visit.k_base)),
        v_base(reinterpret_cast<const char*>(visit.v_base)),
        table(visit.table),
        block_stride_bytes(visit.args.cache_block_stride * int64_t(sizeof(T))),
        span_bytes(visit.item.num_kv_heads * visit.args.cache_head_stride * int64_t(sizeof(T))),
        window(kLoadAheadBytes / (2 * span_bytes) > 1 ? kLoadAheadBytes / (2 * span_bytes) : 1),
        next(visit.item.kv_begin / visit.args.block_size),
        end((visit.item.kv_end - 1) / visit.args.block_size + 1) {}

  // Called with the block a visit reads: when fewer than `window` blocks past it are loaded,
  // loads up to two windows past it.
  void keep_ahead_of(int64_t block) {
    if (next - block > window || next >= end) return;
    const int64_t from = next > block ? next : block;
    const int64_t stop = from + 2 * window < end ? from + 2 * window : end;
    uint64_t sum = 0;
    for (; next < stop; ++next) {
      const int64_t offset = table[next] * block_stride_bytes;
      for (int64_t byte = 0; byte < span_bytes; byte += 64) {
        uint64_t k, v;
        std::memcpy(&k, k_base + offset + byte, sizeof k);
        std::memcpy(&v, v_base + offset + byte, sizeof v);
        sum += k ^ v;
      }
    }
    asm volatile("" : : "r"(sum));  // the loads are the point: the compiler must keep them
  }
};

// chunk(visit) for each chunk of keys the item visits, in order, with `visit` located on it
// (its head, start and length; its rows still to be read) and, with kLoadAhead, the blocks
// past it loaded ahead.
template <class C, int D, bool kLoadAhead, class Chunk>
inline void for_each_visit(const AttentionArgs& args, const WorkItem& item, const Chunk& chunk) {
  VisitRows<C, D> visit(args, item);
  BlockLoader<C, D> loader(visit);
  for (int p = 0; p < visit.order.size(); ++p) {
    visit.locate(p);
    if constexpr (kLoadAhead) loader.keep_ahead_of(visit.start / args.block_size);
    chunk(visit);
  }
}

// One cache row's D values in the rows' type W (exact: an int8 |q| <= 127, a bf16 widened to
// fp32), and its scale (an int8 row's; 1 for a bf16 row).
template <int D, class W, class C>
inline float widen_row(const C* row, W* out) {
  for (int c = 0; c < D; c += kLanes) vstore(out + c, vload(row + c));
  float scale = 1.0f;
  if constexpr (std::is_same_v<C, int8_t>) std::memcpy(&scale, row + D, sizeof scale);
  return scale;
}

// A visit's rows widened into the rows' type W, once a visit for all the rows that read them:
// - an int8 cache's rows: the visit then runs the arithmetic of a cache in W over half (bf16)
//   or a quarter (fp32) of the bytes read from memory. The rows' scales are applied per key
//   instead: K's to the scores, V's to the probabilities (softmax_chunk), a multiply a chunk
//   rather than one per element;
// - a bf16 cache's rows on a tier without a bf16 dot product (kWidenBf16Rows): widened once here
//   rather than once per row in every product (a long chunk has up to 16 rows per kv head).
// K rows past the visit's length point at row 0, as VisitRows::rows does, with scale 0.
template <class W, int D>
struct WidenedRows {
  alignas(64) W k[kChunk][D];
  alignas(64) W v[kChunk][D];
  alignas(64) float k_scale[kChunk];
  alignas(64) float v_scale[kChunk];

  template <class C>
  void fill(const C* const* k_src, const C* const* v_src, int n, const W** k_rows, const W** v_rows) {
    for (int t = 0; t < n; ++t) {
      k_scale[t] = widen_row<D>(k_src[t], k[t]);
      v_scale[t] = widen_row<D>(v_src[t], v[t]);
      k_rows[t] = k[t];
      v_rows[t] = v[t];
    }
    for (int t = n; t < kChunk; ++t) {
      k_rows[t] = k[0];
      k_scale[t] = v_scale[t] = 0.0f;
    }
  }
};

struct NoWidenedRows {};

// The rows' element type W for a query of type T: T itself, or fp32 for a bf16 query on a tier
// without a bf16 dot product, whose products are fp32 FMAs on widened values either way: the
// query is then widened once and K/V once a visit (WidenedRows) rather than in every
// product, from the tier's kWidenBf16FromRows rows an item.
#ifdef CONTBATCH_BF16_PAIR_PV
constexpr int kWidenBf16Rows = 0;  // never: vdpbf16ps multiplies bf16 as it is
#else
constexpr int kWidenBf16Rows = kWidenBf16FromRows;
#endif

#ifdef CONTBATCH_BF16_PAIR_PV
// Items of many rows (a prefill chunk's query tokens x the heads of a kv head) over a bf16
// cache on the AVX512_BF16 tier run with their rows in lanes: lane r of every vector is row
// r. A chunk's scores are then 16 vectors, one a key, each the sum of vdpbf16ps products of
// the key's broadcast bf16 pairs with the rows' query pairs; the online softmax is vertical
// (no horizontal max or sum, no branch a row), and p leaves it as (p[t], p[t + 1]) pairs a
// row, as p * V (accumulate_pv_pairs) takes them. By rows (softmax_chunk, qk_tile) each
// row's scores took 16 K rows' products and a 16-vector transposing sum.
constexpr int kRowLanesFromRows = 12;

template <int NC>
struct RowLanes {
  static constexpr int kPairs = 8 * NC;           // bf16 pairs of a row of D = 16 * NC
  alignas(64) uint32_t q[kPairs][kLanes];          // query pair j of row r in lane r, 0 past the rows
  alignas(64) uint32_t p[kChunk / 2][kLanes];      // the chunk's (p[2i], p[2i + 1]) of row r in lane r
  alignas(64) float m[kLanes];                     // running max of the base-2 scores
  alignas(64) float l[kLanes];                     // running sum of the bf16-rounded p
  alignas(64) int32_t lo[kLanes], hi[kLanes];      // visible key positions [lo, hi); empty past the rows
};

template <int NC>
void load_row_lanes(RowLanes<NC>& lanes, const Rows<uint16_t, NC>& rows) {
  for (int j = 0; j < lanes.kPairs; ++j) {
    for (int r = 0; r < kLanes; ++r) {
      uint32_t pair = 0;
      if (r < rows.count) std::memcpy(&pair, rows.query[r] + 2 * j, sizeof pair);
      lanes.q[j][r] = pair;
    }
  }
  for (int r = 0; r < kLanes; ++r) {
    lanes.m[r] = -INFINITY;
    lanes.l[r] = 0.0f;
    lanes.lo[r] = r < rows.count ? rows.lo[r] : 0;
    lanes.hi[r] = r < rows.count ? rows.hi[r] : 0;
  }
}

// p rounded to bf16: the bits in the low half of each int32 lane, and the rounded values.
inline __m512i bf16_bits(Vec16 p, Vec16& rounded) {
  const __m512i bits = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  rounded = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  return bits;
}

// softmax_chunk's work for every row at once, the rows' alpha left in rows.alpha and the
// chunk's p pairs in lanes.p.
template <int NC>
void softmax_chunk_by_lanes(Rows<uint16_t, NC>& rows, RowLanes<NC>& lanes, const uint16_t* const* k_rows,
                            int32_t c0, int n, Vec16 scale_log2) {
  Vec16 s[kChunk];
  for (Vec16& score : s) score = vzero();
  for (int j = 0; j < lanes.kPairs; ++j) {
    const __m512bh q = reinterpret_cast<__m512bh>(_mm512_load_si512(lanes.q[j]));
    for (int t = 0; t < kChunk; ++t) {  // K is padded to kChunk rows (VisitRows::rows)
      uint32_t pair;
      std::memcpy(&pair, k_rows[t] + 2 * j, sizeof pair);
      s[t] = _mm512_dpbf16_ps(s[t], reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(pair))), q);
    }
  }
  const __m512i lo = _mm512_load_si512(lanes.lo), hi = _mm512_load_si512(lanes.hi);
  Mask16 keep[kChunk];
  Vec16 chunk_max = vset1(-INFINITY);
  for (int t = 0; t < n; ++t) {
    const __m512i pos = _mm512_set1_epi32(c0 + t);
    keep[t] = _mm512_cmp_epi32_mask(lo, pos, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(pos, hi, _MM_CMPINT_LT);
    s[t] = vmask_fill(keep[t], vmul(s[t], scale_log2), -INFINITY);
    chunk_max = vmax(chunk_max, s[t]);
  }
  const Vec16 m_old = vload(lanes.m);
  const Vec16 m = vmax(m_old, chunk_max);
  const Vec16 alpha = vexp2(vsub(m_old, m));  // a lane with no visible key yet: -inf - -inf, ~0
  Vec16 l = vmul(vload(lanes.l), alpha);
  for (int i = 0; 2 * i < n; ++i) {
    Vec16 even, odd = vzero();
    const __m512i even_bits = bf16_bits(vmaskz(keep[2 * i], vexp2(vsub(s[2 * i], m))), even);
    __m512i odd_bits = _mm512_setzero_si512();
    if (2 * i + 1 < n) odd_bits = bf16_bits(vmaskz(keep[2 * i + 1], vexp2(vsub(s[2 * i + 1], m))), odd);
    _mm512_store_si512(lanes.p[i], _mm512_or_si512(even_bits, _mm512_slli_epi32(odd_bits, 16)));
    l = vadd(l, vadd(even, odd));  // l sums what p * V uses
  }
  vstore(lanes.m, m);
  vstore(lanes.l, l);
  vstore(rows.alpha, alpha);  // rows.alpha has kMaxRows = kLanes entries
}

template <int NC>
void accumulate_chunk_by_lanes(Rows<uint16_t, NC>& rows, const RowLanes<NC>& lanes, const uint16_t* const* v_rows,
                               int n) {
  for_row_blocks<max_row_block<NC>()>(rows.count, [&](auto block, int r) {
    const auto pair_of = [&p = lanes.p, r](int i, int t) { return int32_t(p[t / 2][r + i]); };
    accumulate_pv_pairs<NC, decltype(block)::size>(rows.acc[r], rows.kAccLen, rows.alpha + r, pair_of, v_rows, n);
  });
}

// attend_item for a bf16 query over a bf16 cache, rows in lanes.
template <int NC>
void attend_item_by_lanes(const AttentionArgs& args, const WorkItem& item, float* partials) {
  static_assert(kMaxRows == kLanes, "an item's rows of one kv head fill one vector's lanes");
  Rows<uint16_t, NC> rows[kMaxKvHeadsPerItem];
  RowLanes<NC> lanes[kMaxKvHeadsPerItem];
  for (int g = 0; g < item.num_kv_heads; ++g) {
    load_rows<uint16_t>(rows[g], args, kv_head_slice(args, item, g));
    load_row_lanes(lanes[g], rows[g]);
  }
  const Vec16 scale_log2 = vset1(args.scale * kLog2e);
  for_each_visit<uint16_t, 16 * NC, true>(args, item, [&](VisitRows<uint16_t, 16 * NC>& visit) {
    const uint16_t* k_rows[kChunk];
    const uint16_t* v_rows[kChunk];
    visit.rows(k_rows, v_rows);
    softmax_chunk_by_lanes(rows[visit.head], lanes[visit.head], k_rows, visit.start, visit.length, scale_log2);
    accumulate_chunk_by_lanes(rows[visit.head], lanes[visit.head], v_rows, visit.length);
  });
  for (int g = 0; g < item.num_kv_heads; ++g) {
    for (int r = 0; r < rows[g].count; ++r) {  // store_rows reads m and the lane sums of l
      rows[g].m[r] = lanes[g].m[r];
      vstore(rows[g].l[r], vzero());
      rows[g].l[r][0] = lanes[g].l[r];
    }
    store_rows<uint16_t>(rows[g], args, kv_head_slice(args, item, g), partials);
  }
}
#endif  // CONTBATCH_BF16_PAIR_PV

// T: the query's (and out's) element type; W: the rows', T or fp32 (kWidenBf16Rows); C: the
// cache's, T itself or int8_t.
template <class T, class W, class C, int NC>
void attend_item(const AttentionArgs& args, const WorkItem& item, float* partials) {
#ifdef CONTBATCH_BF16_PAIR_PV
  if constexpr (std::is_same_v<W, uint16_t> && std::is_same_v<C, uint16_t>) {
    if (item.num_heads * item.num_queries >= kRowLanesFromRows) return attend_item_by_lanes<NC>(args, item, partials);
  }
#endif
  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
  constexpr bool kWidened = !std::is_same_v<C, W>;
  Rows<W, NC> rows[kMaxKvHeadsPerItem];
  for (int g = 0; g < item.num_kv_heads; ++g) load_rows<T>(rows[g], args, kv_head_slice(args, item, g));
  const Vec16 scale_log2 = vset1(args.scale * kLog2e);
  const W* k_rows[kChunk];
  const W* v_rows[kChunk];
  [[maybe_unused]] std::conditional_t<kWidened, WidenedRows<W, 16 * NC>, NoWidenedRows> widened;
  constexpr bool kLoadAhead = !kWidened || kLoadAheadOfWidenedRows;
  for_each_visit<C, 16 * NC, kLoadAhead>(args, item, [&](VisitRows<C, 16 * NC>& visit) {
    Vec16 key_scale_log2 = scale_log2;
    const float* value_scales = nullptr;
    if constexpr (kWidened) {
      const C* k_cache_rows[kChunk];
      const C* v_cache_rows[kChunk];
      visit.rows(k_cache_rows, v_cache_rows);
      widened.fill(k_cache_rows, v_cache_rows, visit.length, k_rows, v_rows);
      if constexpr (kInt8Cache) {
        key_scale_log2 = vmul(scale_log2, vload(widened.k_scale));
        value_scales = widened.v_scale;
      }
    } else {
      visit.rows(k_rows, v_rows);
    }
    Rows<W, NC>& head_rows = rows[visit.head];
    softmax_chunk(head_rows, k_rows, visit.start, visit.length, key_scale_log2, value_scales);
    accumulate_chunk(head_rows, v_rows, visit.length);
  });
  for (int g = 0; g < item.num_kv_heads; ++g) store_rows<T>(rows[g], args, kv_head_slice(args, item, g), partials);
}

// Combines the partial results of kv head g of one item split into num_parts partitions.
template <class T>
void reduce_kv_head(const AttentionArgs& args, const WorkItem* parts, int num_parts, const float* partials, int g) {
  const WorkItem item = kv_head_slice(args, parts[0], g);
  const int64_t slice_offset = item.partial - parts[0].partial;  // the same in every partition
  const int heads = item.num_heads;
  const int rows = heads * item.num_queries;
  const int64_t D = args.head_size;
  T* out_base = static_cast<T*>(args.out);
  for (int r = 0; r < rows; ++r) {
    float m = -INFINITY;
    for (int i = 0; i < num_parts; ++i) m = std::fmax(m, partials[parts[i].partial + slice_offset + r]);
    float l = 0.0f;
    for (int i = 0; i < num_parts; ++i) {
      const float* part = partials + parts[i].partial + slice_offset;
      l += part[rows + r] * std::exp2(part[r] - m);
    }
    const int qi = r / heads, h = r % heads;
    T* dst = out_base + (item.token_begin + qi) * args.out_token_stride + (item.head_begin + h) * args.out_head_stride;
    for (int64_t d = 0; d < D; d += 16) {
      Vec16 sum = vzero();
      for (int i = 0; i < num_parts; ++i) {
        const float* part = partials + parts[i].partial + slice_offset;
        if (part[r] == -INFINITY) continue;  // no visible key in this partition
        sum = vfma(vset1(std::exp2(part[r] - m) / l), vload(part + 2 * rows + r * D + d), sum);
      }
      vstore(dst + d, sum);
    }
  }
}

template <class T>
void reduce_item_partitions(const AttentionArgs& args, const WorkItem* parts, int num_parts, const float* partials) {
  for (int g = 0; g < parts[0].num_kv_heads; ++g) reduce_kv_head<T>(args, parts, num_parts, partials, g);
}

template <class T, class C, int NC>
void attend_rows(const AttentionArgs& args, const WorkItem& item, float* partials) {
  if constexpr (sizeof(T) == 2 && kWidenBf16Rows > 0) {
    if (item.num_heads * item.num_queries >= kWidenBf16Rows) return attend_item<T, float, C, NC>(args, item, partials);
  }
  attend_item<T, T, C, NC>(args, item, partials);
}

template <class T, class C>
void attend_dispatch(const AttentionArgs& args, const WorkItem& item, float* partials) {
  switch (args.head_size / 16) {  // the driver checks head_size is 16, 32, ..., 256
    case 1: return attend_rows<T, C, 1>(args, item, partials);
    case 2: return attend_rows<T, C, 2>(args, item, partials);
    case 3: return attend_rows<T, C, 3>(args, item, partials);
    case 4: return attend_rows<T, C, 4>(args, item, partials);
    case 5: return attend_rows<T, C, 5>(args, item, partials);
    case 6: return attend_rows<T, C, 6>(args, item, partials);
    case 7: return attend_rows<T, C, 7>(args, item, partials);
    case 8: return attend_rows<T, C, 8>(args, item, partials);
    case 9: return attend_rows<T, C, 9>(args, item, partials);
    case 10: return attend_rows<T, C, 10>(args, item, partials);
    case 11: return attend_rows<T, C, 11>(args, item, partials);
    case 12: return attend_rows<T, C, 12>(args, item, partials);
    case 13: return attend_rows<T, C, 13>(args, item, partials);
    case 14: return attend_rows<T, C, 14>(args, item, partials);
    case 15: return attend_rows<T, C, 15>(args, item, partials);
    case 16: return attend_rows<T, C, 16>(args, item, partials);
    default: return;
  }
}

// bf16 travels as raw uint16_t bits.
void attend(const AttentionArgs& args, const WorkItem& item, float* partials) {
  if (args.bf16) {
    return args.int8_cache ? attend_dispatch<uint16_t, int8_t>(args, item, partials)
                           : attend_dispatch<uint16_t, uint16_t>(args, item, partials);
  }
  return args.int8_cache ? attend_dispatch<float, int8_t>(args, item, partials)
                         : attend_dispatch<float, float>(args, item, partials);
}

void reduce_partitions(const AttentionArgs& args, const WorkItem* parts, int num_parts, const float* partials) {
  if (args.bf16) {
    reduce_item_partitions<uint16_t>(args, parts, num_parts, partials);
  } else {
    reduce_item_partitions<float>(args, parts, num_parts, partials);
  }
}

constexpr AttentionKernels kKernels{&attend, &reduce_partitions};
