// bf16 pair dot products for the linear kernel (linear_kernel.h) on tiers without a bf16
// dot-product instruction (generic, AVX2, AVX-512 without AVX512_BF16): bf16 weights are
// widened to fp32 by a 16-bit shift and multiplied by fp32 FMAs, the odd products added
// before the even ones (vdpbf16ps's order). Products of bf16 are exact in fp32, so only the
// order of the fp32 sums differs from a bf16 dot-product instruction. Included by the simd
// header of such a tier after its Vec16 functions, vload_odd and vload_even.
//
// Layout of a pair row: element 2i is input 2k of column i, element 2i + 1 input 2k + 1.

// linear_kernel.h widens whole panels to fp32 for calls with many rows.
#define CONTBATCH_WIDENS_PANELS 1

// One row's input pair, widened to fp32 once per row tile (not once per column tile).
struct StagedPair {
  float even, odd;
};

inline float bf16_bits_to_float(uint32_t high_bits) {  // the bf16 in bits 16-31, zeros below
  float f;
  std::memcpy(&f, &high_bits, sizeof f);
  return f;
}

// bits: input 2k in bits 0-15, input 2k + 1 in bits 16-31.
inline StagedPair stage_pair(uint32_t bits) {
  return {bf16_bits_to_float(bits << 16), bf16_bits_to_float(bits & 0xFFFF0000u)};
}
constexpr bool kPairsBroadcastAsStored = false;

// acc[m][v] += the pair row w's columns 16v.. times row m's staged pair x(m): the odd
// inputs for all MR rows first, then the even ones, so that only NV widened weight vectors
// are live beside the MR x NV accumulators (vload_odd / vload_even: the tier's widening loads).
template <int MR, int NV, class PairOfRow>
inline void accumulate_pair_row(Vec16 (&acc)[MR][NV], const uint16_t* w, const PairOfRow& x) {
  Vec16 weights[NV];
  for (int v = 0; v < NV; ++v) weights[v] = vload_odd(w + 2 * kLanes * v);
  for (int m = 0; m < MR; ++m) {
    const Vec16 input = vset1(x(m).odd);
    for (int v = 0; v < NV; ++v) acc[m][v] = vfma(weights[v], input, acc[m][v]);
  }
  for (int v = 0; v < NV; ++v) weights[v] = vload_even(w + 2 * kLanes * v);
  for (int m = 0; m < MR; ++m) {
    const Vec16 input = vset1(x(m).even);
    for (int v = 0; v < NV; ++v) acc[m][v] = vfma(weights[v], input, acc[m][v]);
  }
}

// Query and accumulator rows of the attention kernel: as long as the head, no padding.
template <class T, int NC>
constexpr int query_row_len() {
  return NC * 16;
}
template <class T, int NC>
constexpr int acc_row_len() {
  return NC * 16;
}
