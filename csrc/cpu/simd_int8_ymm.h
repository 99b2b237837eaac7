// The parts of the int8 section (int8_linear_kernel.h) that the 256-bit tiers (AVX2's
// vpmaddwd kernel and AVX-VNNI's) share: fp16 scales in, quantized activations out.
#pragma once

inline Vec16 vload_f16(const uint16_t* h) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)))};
}
inline void i8_store_rounded(int8_t* q, Vec16 v) {  // |v| <= 127 by construction
  const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
  const __m256i ordered = _mm256_permute4x64_epi64(words, 0xD8);  // [lo 0-7 | hi 0-7]
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(ordered), _mm256_extracti128_si256(ordered, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), bytes);
}
