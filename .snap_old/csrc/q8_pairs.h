// 64-weight pair decoders for the 512-bit int8-activation kernels (AVX-512 VNNI tier): blocks
// b and b + 1 of a row as one vector of bytes, with one scale (and min) per 32-bit lane.
//
// Formats whose offset kOff is 0 or a power of two give their raw unsigned quants w: the
// kernel removes kOff * sum(x) through the activations' group bias gb = -128 * sum(x), shifted
// (`raw_bias`), once per activation rather than once per row. The integer dot product is the
// one of (w - kOff) * x either way, so results keep their bits.
// Included by the VNNI translation unit only.
#pragma once

#include <immintrin.h>

#include "q8_blocks.h"

namespace ft {
namespace q8 {

// Whether D's pair decoder gives raw quants (see above).
template <class D>
constexpr bool kRaw = !D::kSigned && (D::kOff & (D::kOff - 1)) == 0 && D::kOff <= 128;

// -kOff * sum(x) per group of 4 from gb = -128 * sum(x) (exact: gb is a multiple of 128).
template <class D>
static inline __m512i raw_bias(__m512i gb) {
  if constexpr (D::kOff == 0) {
    return _mm512_setzero_si512();
  } else {
    constexpr int shift = D::kOff == 64 ? 1 : D::kOff == 32 ? 2 : D::kOff == 16 ? 3
                        : D::kOff == 8 ? 4 : D::kOff == 4 ? 5 : D::kOff == 2 ? 6 : 7;
    return _mm512_srai_epi32(gb, shift);
  }
}

// q5_0 blocks b and b + 1 (22 bytes each): the f16 scales are words 0 and 11 of the pair,
// spread to 8 lanes each by one word permute of a masked load (the pair may end the matrix);
// each block's 16 quant bytes go to both 128-bit lanes of its half, the upper one shifted to
// the high nibbles, and the fifth bits are added under a byte mask.
static inline void q5_0_pair(const uint8_t* p, __m512i& w, __m512& ws) {
  const __m512i spread = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 11, 11,
                                          11, 11, 11, 11, 11, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512i h = _mm512_permutexvar_epi16(spread, _mm512_maskz_loadu_epi16(0x3FFFFF, p));
  ws = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  __m256i q0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p + 6)));
  __m256i q1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p + 28)));
  __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
  q = _mm512_mask_srli_epi16(q, 0xFF00FF00u, q, 4);
  q = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
  __mmask64 hi = (uint64_t)load_u32(p + 2) | (uint64_t)load_u32(p + 24) << 32;
  w = _mm512_mask_add_epi8(q, hi, q, _mm512_set1_epi8(0x10));
}

// q4_k pair K of a super-block: one 32-byte chunk, its low nibbles then its high ones.
template <int K>
static inline __m512i q4_k_pair(const uint8_t* p) {
  __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 16 + 32 * K)));
  q = _mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4);
  return _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
}

// q5_k pair K: q4_k's (its nibbles 32 bytes further on), plus 16 where bit 2K (first half) or
// 2K + 1 (second half) of the weight's qh byte is set.
template <int K>
static inline __m512i q5_k_pair(const uint8_t* p) {
  __m512i q = q4_k_pair<K>(p + 32);
  __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 16)));
  const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(1 << (2 * K)),
                                         _mm256_set1_epi8(1 << (2 * K + 1)), 1);
  return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(0x10));
}

// q6_k pair K: 64 bytes of ql (low nibbles for even K, high for odd) and the 32 bytes of qh of
// half K / 2, two bits per weight moved to bits 4-5 (by 4 and 2 for even K, 0 and -2 for odd).
template <int K>
static inline __m512i q6_k_pair(const uint8_t* p) {
  constexpr int h = K / 2, sel = K & 1;
  __m512i lo = _mm512_loadu_si512(p + 64 * h);
  if (sel) lo = _mm512_srli_epi16(lo, 4);
  __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h)));
  if (sel)
    qh = _mm512_mask_srli_epi16(qh, 0xFFFF0000u, qh, 2);
  else
    qh = _mm512_mask_slli_epi16(_mm512_slli_epi16(qh, 2), 0x0000FFFFu, qh, 4);
  qh = _mm512_and_si512(qh, _mm512_set1_epi8(0x30));
  // (lo & 0x0F) | qh
  return _mm512_ternarylogic_epi32(lo, _mm512_set1_epi8(0x0F), qh, 0xEA);
}

// Per-super-block scales in one vector: q4_k (and q5_k): d * scale of sub-blocks 0-7, then
// dmin * min / 128 (the mins meet gb = -128 * sum(x)); q6_k: d * scale of its 16 groups.
static inline __m512 q4_k_scales(const uint8_t* p) {
  __m512 i = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(Q4_K::super_scale_bytes(p)));
  __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
  __m256 dmin = _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2)) * (1.0f / 128));
  return _mm512_mul_ps(i, _mm512_insertf32x8(_mm512_castps256_ps512(d), dmin, 1));
}

static inline __m512 q6_k_scales(const uint8_t* p) {
  __m512 i = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 192))));
  return _mm512_mul_ps(i, _mm512_set1_ps(_cvtsh_ss(load_u16(p + 208))));
}

// Lane l of pair K belongs to sub-block 2K + l / 8 (q4_k, q5_k) or group 4K + l / 4 (q6_k).
template <int K>
static inline void q4_k_pair_scales(__m512 s, __m512& ws, __m512& wm) {
  const __m512i idx = _mm512_setr_epi32(2 * K, 2 * K, 2 * K, 2 * K, 2 * K, 2 * K, 2 * K, 2 * K,
                                        2 * K + 1, 2 * K + 1, 2 * K + 1, 2 * K + 1, 2 * K + 1,
                                        2 * K + 1, 2 * K + 1, 2 * K + 1);
  ws = _mm512_permutexvar_ps(idx, s);
  wm = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), s);
}

template <int K>
static inline __m512 q6_k_pair_scales(__m512 s) {
  const __m512i idx = _mm512_setr_epi32(4 * K, 4 * K, 4 * K, 4 * K, 4 * K + 1, 4 * K + 1,
                                        4 * K + 1, 4 * K + 1, 4 * K + 2, 4 * K + 2, 4 * K + 2,
                                        4 * K + 2, 4 * K + 3, 4 * K + 3, 4 * K + 3, 4 * K + 3);
  return _mm512_permutexvar_ps(idx, s);
}

}  // namespace q8
}  // namespace ft
