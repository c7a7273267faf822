// AVX-512 (F, BW, VL, DQ) tier: float-activation kernels for the formats that are decoded to
// floats (bf16, f32, nvfp4, fp8_block), 16 weights per instruction. Int formats fall back to
// AVX2.
#include <immintrin.h>

#include "common.h"
#include "prefetch.h"

namespace ft {
namespace {

// Per-row decoders: 16 weights at element i as floats (mask: valid lanes).
struct BF16 {
  static constexpr int kStep = 16;
  static constexpr int kBytes = 4;  // per 2 weights
  static inline __m512 load(const Mat&, const uint8_t* row, int64_t, int64_t i, __mmask16 k) {
    __m256i v = _mm256_maskz_loadu_epi16(k, row + 2 * i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
};

struct F32 {
  static constexpr int kStep = 16;
  static constexpr int kBytes = 8;  // per 2 weights
  static inline __m512 load(const Mat&, const uint8_t* row, int64_t, int64_t i, __mmask16 k) {
    return _mm512_maskz_loadu_ps(k, row + 4 * i);
  }
};

struct NVFP4 {
  static constexpr int kStep = 16;
  static constexpr int kBytes = 1;  // per 2 weights
  static inline __m512 load(const Mat& m, const uint8_t* row, int64_t r, int64_t i, __mmask16) {
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                      -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m128i b = _mm_loadl_epi64((const __m128i*)(row + i / 2));
    __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    codes = _mm512_and_si512(_mm512_srlv_epi32(codes, shifts), _mm512_set1_epi32(15));
    float s = e4m3_to_f32(m.scale[r * m.scale_row_bytes + i / 16]) * m.scale2;
    return _mm512_mul_ps(_mm512_permutexvar_ps(codes, lut), _mm512_set1_ps(s));
  }
};

struct FP8Block {
  static constexpr int kStep = 16;
  static constexpr int kBytes = 2;  // per 2 weights
  static inline __m512 load(const Mat& m, const uint8_t* row, int64_t r, int64_t i,
                            __mmask16 k) {
    // e4m3 bits placed in an f16 (exponent bias 15 instead of 7): the value times 2^-8.
    __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(k, row + i));
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    __m512 v = _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
    const float* srow = (const float*)(m.scale + (r / 128) * m.scale_row_bytes);
    return _mm512_mul_ps(v, _mm512_set1_ps(srow[i / 128] * 256.0f));
  }
};

template <class D, int NV>
void f32_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
              const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const float* x[NV];
  for (int v = 0; v < NV; ++v) x[v] = a.f + (vidx ? vidx[v0 + v] : v0 + v) * a.K;
  const int64_t ahead = prefetch_bytes();
  const int level = prefetch_level();
  prefetch_start(m.data + r0 * m.row_bytes, (r1 - r0) * m.row_bytes, ahead, level);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.data + r * m.row_bytes;
    __m512 acc[NV][2];
    for (int v = 0; v < NV; ++v) acc[v][0] = acc[v][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= cols; i += 32) {
      prefetch((const char*)row + i * D::kBytes / 2 + ahead, level);
      __m512 w0 = D::load(m, row, r, i, 0xFFFF), w1 = D::load(m, row, r, i + 16, 0xFFFF);
      for (int v = 0; v < NV; ++v) {
        acc[v][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[v] + i), acc[v][0]);
        acc[v][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[v] + i + 16), acc[v][1]);
      }
    }
    for (; i < cols; i += 16) {
      __mmask16 k = cols - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - i)) - 1);
      __m512 w0 = D::load(m, row, r, i, k);
      for (int v = 0; v < NV; ++v)
        acc[v][0] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(k, x[v] + i), acc[v][0]);
    }
    for (int v = 0; v < NV; ++v)
      out[(int64_t)(v0 + v) * ldo + (r - r0)] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[v][0], acc[v][1]));
  }
}

template <class D>
void gemv_f32(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
              const int32_t* vidx, int n, float* out, int64_t ldo) {
  int v0 = 0;
  for (; v0 + 4 <= n; v0 += 4) f32_rows<D, 4>(m, cols, r0, r1, a, vidx, v0, out, ldo);
  switch (n - v0) {
    case 3: f32_rows<D, 3>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 2: f32_rows<D, 2>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 1: f32_rows<D, 1>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
  }
}

// quantize_q8 sixteen lanes at a time, with its bits: the same max, scale, round-to-nearest-even
// and clamp, and group sums of four bytes through maddubs/madd.
void quantize_q8_avx512(const float* x, int64_t K, int8_t* q, float* d, float* dl, int32_t* gs,
                        int32_t* gb) {
  const __m512 sign = _mm512_set1_ps(-0.0f), hi = _mm512_set1_ps(127.0f),
               lo = _mm512_set1_ps(-127.0f);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    float db = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = db;
    const __m512 vid = _mm512_set1_ps(id);
    auto quant = [&](__m512 v) {
      v = _mm512_roundscale_ps(_mm512_mul_ps(v, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)));
    };
    __m256i qb = _mm256_inserti128_si256(_mm256_castsi128_si256(quant(x0)), quant(x1), 1);
    _mm256_storeu_si256((__m256i*)(q + 32 * b), qb);
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qb), ones16);
    _mm256_storeu_si256((__m256i*)(gs + 8 * b), s);
    _mm256_storeu_si256((__m256i*)(gb + 8 * b), _mm256_mullo_epi32(s, _mm256_set1_epi32(-128)));
    _mm256_storeu_ps(dl + 8 * b, _mm256_set1_ps(db));
  }
}

uint64_t read_avx512(const uint8_t* p, int64_t bytes) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0;
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(p + i));
    acc1 = _mm512_xor_si512(acc1, _mm512_loadu_si512(p + i + 64));
  }
  for (; i < bytes; i += 64) acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(p + i));
  return (uint64_t)_mm512_reduce_add_epi64(_mm512_xor_si512(acc0, acc1));
}

}  // namespace

void register_avx512(KernelTable& t) {
  t.fn[F_BF16][ACT_F32][ISA_AVX512] = gemv_f32<BF16>;
  t.fn[F_NVFP4][ACT_F32][ISA_AVX512] = gemv_f32<NVFP4>;
  t.fn[F_FP8_BLOCK][ACT_F32][ISA_AVX512] = gemv_f32<FP8Block>;
  t.fn[F_F32][ACT_F32][ISA_AVX512] = gemv_f32<F32>;
  t.read[ISA_AVX512] = read_avx512;
  t.quant[ISA_AVX512] = quantize_q8_avx512;
}

}  // namespace ft
