// 32-element block decoders for the int8-activation kernels (AVX2 and AVX-512 VNNI tiers).
// Each format turns block b of a row into 32 small integers w (one per byte), a scale per
// element group in `ws` (8 lanes, one per 4 elements) and, for formats with mins, `wm`, so that
//   weight[i] = ws[i / 4] * (w[i] - kOff) - wm[i / 4].
// The super-block formats (kSuper: q4_k, q5_k, q6_k) give a super-block's scales at once and
// the quants of its pairs of blocks instead.
// kSigned: w holds signed int8 (q8_0); otherwise unsigned bytes below 64. nvfp4's block reads
// its scales from a row of their own as well (the kernels pass it: row_groups.h's Apart).
// Included by ISA translation units only; everything is static inline (one copy per tier).
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "common.h"

namespace ft {
namespace q8 {

static inline __m256i nibbles32(const uint8_t* qs16) {
  __m128i b = _mm_loadu_si128((const __m128i*)qs16);
  __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// 0xFF in byte i where bit i of x is set.
static inline __m256i bits_to_bytes(uint32_t x) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_movm_epi8(x);
#else
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                          2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
#endif
}

struct Q8_0 {
  static constexpr bool kSuper = false;
  static constexpr int kBlockBytes = FMT_INFO[F_Q8_0].block_bytes;  // per 32 weights
  static constexpr int kOff = 0;
  static constexpr bool kSigned = true, kMins = false;
  static inline void block(const uint8_t* row, int64_t b, __m256i& w, __m256& ws, __m256&) {
    const uint8_t* p = row + kBlockBytes * b;
    ws = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    w = _mm256_loadu_si256((const __m256i*)(p + 2));
  }
};

struct Q4_0 {
  static constexpr bool kSuper = false;
  static constexpr int kBlockBytes = FMT_INFO[F_Q4_0].block_bytes;  // per 32 weights
  static constexpr int kOff = 8;
  static constexpr bool kSigned = false, kMins = false;
  static inline void block(const uint8_t* row, int64_t b, __m256i& w, __m256& ws, __m256&) {
    const uint8_t* p = row + kBlockBytes * b;
    ws = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    w = nibbles32(p + 2);
  }
};

struct Q5_0 {
  static constexpr bool kSuper = false;
  static constexpr int kBlockBytes = FMT_INFO[F_Q5_0].block_bytes;  // per 32 weights
  static constexpr int kOff = 16;
  static constexpr bool kSigned = false, kMins = false;
  static inline void block(const uint8_t* row, int64_t b, __m256i& w, __m256& ws, __m256&) {
    const uint8_t* p = row + kBlockBytes * b;
    ws = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    __m256i hi = _mm256_and_si256(bits_to_bytes(load_u32(p + 2)), _mm256_set1_epi8(0x10));
    w = _mm256_or_si256(nibbles32(p + 6), hi);
  }
};

struct MXFP4 {
  static constexpr bool kSuper = false;
  static constexpr int kBlockBytes = FMT_INFO[F_MXFP4].block_bytes;  // per 32 weights
  static constexpr int kOff = 12;
  static constexpr bool kSigned = false, kMins = false;
  static inline void block(const uint8_t* row, int64_t b, __m256i& w, __m256& ws, __m256&) {
    const uint8_t* p = row + kBlockBytes * b;
    // twice the e2m1 value of each code, plus 12
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4,
                                         0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6,
                                         4, 0);
    ws = _mm256_set1_ps(e8m0_half(p[0]));
    w = _mm256_shuffle_epi8(lut, nibbles32(p + 1));
  }
};

// nvfp4 (its e4m3 scales kept apart from the codes, in `srow`, one per 16 weights; the
// global scale is the caller's): 32 codes in 16 bytes, byte j holding weight 2j in its low
// nibble and 2j + 1 in its high one, put in order and looked up as mxfp4's doubled e2m1 values
// plus 12; lanes 0-3 (weights 0-15) get sub-block 2b's scale, lanes 4-7 sub-block 2b + 1's,
// halved for the doubling. The scale of byte 0x7F (NaN) reads as 240: no quantiser writes it.
static inline float e4m3_half(uint8_t s) {
  const int e = (s >> 3) & 15, m = s & 7;
  float v = (float)m * (1.0f / 1024.0f);  // subnormal: m/8 * 2^-6, halved
  if (e) {
    uint32_t bits = (uint32_t)(e + 119) << 23 | (uint32_t)m << 20;
    std::memcpy(&v, &bits, 4);
  }
  return (s & 0x80) ? -v : v;
}

// e4m3_half of every byte, looked up (one table per translation unit).
struct E4M3Halves {
  float v[256];
  E4M3Halves() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_half((uint8_t)i);
  }
};
static const E4M3Halves kE4M3Halves;

struct NVFP4 {
  static constexpr bool kSuper = false;
  static constexpr int kBlockBytes = 2 * FMT_INFO[F_NVFP4].block_bytes;  // codes of 32 weights
  static constexpr int kOff = 12;
  static constexpr bool kSigned = false, kMins = false;
  static inline void block(const uint8_t* row, const uint8_t* srow, int64_t b, __m256i& w,
                           __m256& ws, __m256&) {
    const __m128i c = _mm_loadu_si128((const __m128i*)(row + kBlockBytes * b));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(c, m), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m);
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4,
                                         0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6,
                                         4, 0);
    w = _mm256_shuffle_epi8(
        lut, _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
    ws = _mm256_setr_m128(_mm_set1_ps(kE4M3Halves.v[srow[2 * b]]),
                          _mm_set1_ps(kE4M3Halves.v[srow[2 * b + 1]]));
  }
};

// Block b of a row as D decodes it; nvfp4's reads its scales from `srow`, the row's scale row
// (row_groups.h's Apart), which the other formats leave unread.
template <class D>
static inline void block_at(const uint8_t* row, const uint8_t* srow, int64_t b, __m256i& w,
                            __m256& ws, __m256& wm) {
  if constexpr (std::is_same_v<D, NVFP4>)
    D::block(row, srow, b, w, ws, wm);
  else
    D::block(row, b, w, ws, wm);
}

struct Q4_K {
  static constexpr int kOff = 0;
  static constexpr bool kSigned = false, kMins = true;
  // Whole super-blocks (the grouped kernels): the 8 scales and 8 mins of the 32-weight
  // sub-blocks as integers, unpacked from their 12 bytes by 32-bit word operations.
  static constexpr bool kSuper = true;
  static constexpr int kSuperBytes = 144;
  static inline __m128i super_scale_bytes(const uint8_t* p) {
    uint32_t a = load_u32(p + 4), b = load_u32(p + 8), c = load_u32(p + 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, top = 0x30303030;
    uint32_t sc_lo = a & m6, mn_lo = b & m6;
    uint32_t sc_hi = (c & m4) | ((a >> 2) & top), mn_hi = ((c >> 4) & m4) | ((b >> 2) & top);
    return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi);
  }
  // d * scale and dmin * min of each sub-block.
  static inline void super_scales(const uint8_t* p, __m256& sc, __m256& mn) {
    __m128i q = super_scale_bytes(p);
    sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
                       _mm256_set1_ps(_cvtsh_ss(load_u16(p))));
    mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
                       _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2))));
  }
  // The quants of pair K (sub-blocks 2K and 2K + 1): one 32-byte chunk's low and high nibbles.
  template <int K>
  static inline void pair_quants(const uint8_t* p, __m256i& w0, __m256i& w1) {
    __m256i q = _mm256_loadu_si256((const __m256i*)(p + 16 + 32 * K));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    w0 = _mm256_and_si256(q, mask);
    w1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
  }
};

// Q4_K's super-block with a fifth bit per weight: the same head (d, dmin, scales), then 32 bytes
// qh (bit j of qh[l]: weight l of sub-block j) before the 128 bytes of low nibbles.
struct Q5_K : Q4_K {
  static constexpr int kSuperBytes = 176;
  // Bit B of each byte of qh as 16 (0 elsewhere). The 16-bit shifts move it by at most 4
  // places, so bit 4 of a byte comes from that byte.
  template <int B>
  static inline __m256i fifth_bit(__m256i qh) {
    __m256i h;
    if constexpr (B <= 4)
      h = _mm256_slli_epi16(qh, 4 - B);
    else
      h = _mm256_srli_epi16(qh, B - 4);
    return _mm256_and_si256(h, _mm256_set1_epi8(0x10));
  }
  // Pair K: q4_k's low nibbles (32 bytes further on) with bits 2K and 2K + 1 of qh.
  template <int K>
  static inline void pair_quants(const uint8_t* p, __m256i& w0, __m256i& w1) {
    Q4_K::pair_quants<K>(p + 32, w0, w1);
    __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 16));
    w0 = _mm256_or_si256(w0, fifth_bit<2 * K>(qh));
    w1 = _mm256_or_si256(w1, fifth_bit<2 * K + 1>(qh));
  }
};

struct Q6_K {
  static constexpr int kOff = 32;
  static constexpr bool kSigned = false, kMins = false;
  static constexpr bool kSuper = true;
  static constexpr int kSuperBytes = 210;
  // d * scale of the 16-weight groups 0-7 and 8-15.
  static inline void super_scales(const uint8_t* p, __m256& lo, __m256& hi) {
    __m128i q = _mm_loadu_si128((const __m128i*)(p + 192));
    __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p + 208)));
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d);
  }
  // Blocks 2K and 2K + 1 share half h = K / 2: 64 bytes of ql (one nibble) and 32 of qh.
  template <int K>
  static inline void pair_quants(const uint8_t* p, __m256i& w0, __m256i& w1) {
    constexpr int h = K / 2, sel = K & 1;  // block 2K is sub-row 2 * sel of its half
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    __m256i lo0 = _mm256_loadu_si256((const __m256i*)(p + 64 * h));
    __m256i lo1 = _mm256_loadu_si256((const __m256i*)(p + 64 * h + 32));
    if (sel) {
      lo0 = _mm256_srli_epi16(lo0, 4);
      lo1 = _mm256_srli_epi16(lo1, 4);
    }
    // bits 4 sel and 4 sel + 2 of qh, moved to bits 4-5
    __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h));
    __m256i hi0 = sel ? qh : _mm256_slli_epi16(qh, 4);
    __m256i hi1 = sel ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2);
    w0 = _mm256_or_si256(_mm256_and_si256(lo0, m4), _mm256_and_si256(hi0, m2));
    w1 = _mm256_or_si256(_mm256_and_si256(lo1, m4), _mm256_and_si256(hi1, m2));
  }
};

// x * k for the small constants the formats use as offsets.
template <int K>
static inline __m256i mul_const(__m256i x) {
  return _mm256_mullo_epi32(x, _mm256_set1_epi32(K));
}

}  // namespace q8
}  // namespace ft
