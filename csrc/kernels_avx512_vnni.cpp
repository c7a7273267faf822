// AVX-512 VNNI tier: int formats with int8 activations, two 32-blocks per 512-bit dot product
// (vpdpbusd: unsigned weight bytes times signed activation bytes; q8_0 weights are moved to
// unsigned by +128 and the offset comes back out through the activation group sums).
#include <immintrin.h>

#include <initializer_list>
#include <type_traits>

#include "common.h"
#include "panels.h"
#include "q8_blocks.h"
#include "q8_pairs.h"
#include "row_groups.h"

namespace ft {
namespace {

// Every format's weights are moved to w + 128 (unsigned bytes, no overflow: |w| <= 127 for
// q8_0, < 64 otherwise); the activations' precomputed bias gb = -128 * sum(x) removes it.
template <class D>
static inline __m256i to_u8(__m256i w) {
  if (D::kSigned) return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
  return _mm256_add_epi8(w, _mm256_set1_epi8((char)(128 - D::kOff)));
}

// q8_0 blocks b and b + 1 as one 512-bit vector: both f16 scales sit in the pair's first 64
// bytes (words 0 and 17), spread to their 8 lanes each by one word permute; the quants are
// inserted straight from memory. This keeps the shuffle port to two uops a pair.
static inline void q8_0_pair(const uint8_t* p, __m512i& w, __m512& ws) {
  const __m512i spread = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 17,
                                          17, 17, 17, 17, 17, 17, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512i h = _mm512_permutexvar_epi16(spread, _mm512_loadu_si512(p));
  ws = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(p + 2))),
                         _mm256_loadu_si256((const __m256i*)(p + 36)), 1);
  w = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
}

// Blocks b and b + 1 of a row as one 512-bit vector of bytes (raw quants where kRaw<D>, else
// moved to unsigned by to_u8), with their scales (and mins / 128) per lane.
template <class D>
static inline void q8_pair_weights(const uint8_t* row, const uint8_t* srow, int64_t b,
                                   __m512i& w, __m512& ws, __m512& wm) {
  if constexpr (std::is_same_v<D, q8::Q8_0>) {
    q8_0_pair(row + b * D::kBlockBytes, w, ws);
  } else if constexpr (std::is_same_v<D, q8::Q5_0>) {
    q8::q5_0_pair(row + b * D::kBlockBytes, w, ws);
  } else {
    __m256i w0, w1;
    __m256 s0, s1, m0 = _mm256_setzero_ps(), m1 = m0;
    q8::block_at<D>(row, srow, b, w0, s0, m0);
    q8::block_at<D>(row, srow, b + 1, w1, s1, m1);
    if constexpr (!q8::kRaw<D>) {
      w0 = to_u8<D>(w0);
      w1 = to_u8<D>(w1);
    }
    w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
    ws = _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1);
    if (D::kMins)
      wm = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1),
                         _mm512_set1_ps(1.0f / 128));
  }
}

// The bias a pair's dot product starts from: gb itself for weights moved by to_u8, else
// -kOff * sum(x) (shared by the rows of a group).
template <class D>
static inline __m512i pair_bias(__m512i gb) {
  if constexpr (q8::kRaw<D>)
    return q8::raw_bias<D>(gb);
  else
    return gb;
}

// Pair K of super-block p: its quants and scales (and mins / 128) per lane, from the
// super-block's scales s.
template <class D, int K>
static inline void super_pair(const uint8_t* p, __m512 s, __m512i& w, __m512& ws, __m512& wm) {
  if constexpr (std::is_same_v<D, q8::Q4_K>)
    w = q8::q4_k_pair<K>(p);
  else if constexpr (std::is_same_v<D, q8::Q5_K>)
    w = q8::q5_k_pair<K>(p);
  else
    w = q8::q6_k_pair<K>(p);
  if constexpr (D::kMins)  // q4_k, q5_k
    q8::q4_k_pair_scales<K>(s, ws, wm);
  else
    ws = q8::q6_k_pair_scales<K>(s);
}

template <class D>
static inline __m512 super_scales(const uint8_t* p) {
  if constexpr (D::kMins)  // q4_k, q5_k
    return q8::q4_k_scales(p);
  else
    return q8::q6_k_scales(p);
}

// acc[r][v] += the pair at block b of R rows (w, ws, wm) times vector v's activations.
template <class D, int NV, int R>
static inline void pair_dots(const __m512i* w, const __m512* ws, const __m512* wm, int64_t b,
                             const int8_t* const* xq, const float* const* xdl,
                             const int32_t* const* xgb, __m512 (*acc)[NV]) {
  for (int v = 0; v < NV; ++v) {
    __m512i x = _mm512_loadu_si512(xq[v] + 32 * b);
    __m512i gb = _mm512_loadu_si512(xgb[v] + 8 * b);
    __m512 dl = _mm512_loadu_ps(xdl[v] + 8 * b);
    __m512i bias = pair_bias<D>(gb);
    __m512 fgb = D::kMins ? _mm512_cvtepi32_ps(gb) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, w[r], x)), ws[r]);
      if (D::kMins) t = _mm512_fmadd_ps(wm[r], fgb, t);
      acc[r][v] = _mm512_fmadd_ps(t, dl, acc[r][v]);
    }
  }
}

// R consecutive rows at once, so each activation load serves R rows (an activation's int8
// values, group biases and scales are 9 bytes per weight, against about one byte of weight).
// One accumulator per (row, vector), added to pair by pair in block order: a row's result
// has the same bits whatever R and NV are. The group is one region of R rows, prefetched
// linearly `ahead` of what has been read of it; L: the prefetch level.
template <class D, int NV, int R, int L>
void q8_row_group(const uint8_t* row, int64_t row_bytes, int64_t nb, const int8_t* const* xq,
                  const float* const* xdl, const int32_t* const* xgb, float* res,
                  int64_t ahead, const Apart& apart) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const char* pf = (const char*)row + ahead;
  const char* pf_to = pf;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    for (pf_to += 2 * D::kBlockBytes * R; pf < pf_to; pf += 64) prefetch(pf, L);
    __m512i w[R];
    __m512 ws[R], wm[R];
    for (int r = 0; r < R; ++r) {
      wm[r] = _mm512_setzero_ps();
      q8_pair_weights<D>(row + r * row_bytes, apart.scales + r * apart.scale_row_bytes, b,
                         w[r], ws[r], wm[r]);
    }
    pair_dots<D, NV, R>(w, ws, wm, b, xq, xdl, xgb, acc);
  }
  float tail[R][NV] = {};
  if (b < nb) {  // an odd last block
    for (int r = 0; r < R; ++r) {
      __m256i w;
      __m256 ws, wm = _mm256_setzero_ps();
      q8::block_at<D>(row + r * row_bytes, apart.scales + r * apart.scale_row_bytes, b, w, ws, wm);
      w = to_u8<D>(w);
      wm = _mm256_mul_ps(wm, _mm256_set1_ps(1.0f / 128));
      for (int v = 0; v < NV; ++v) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(xq[v] + 32 * b));
        __m256i gb = _mm256_loadu_si256((const __m256i*)(xgb[v] + 8 * b));
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(gb, w, x)), ws);
        if (D::kMins) t = _mm256_fmadd_ps(wm, _mm256_cvtepi32_ps(gb), t);
        t = _mm256_mul_ps(t, _mm256_loadu_ps(xdl[v] + 8 * b));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        tail[r][v] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      res[r * NV + v] = (_mm512_reduce_add_ps(acc[r][v]) + tail[r][v]) * apart.scale2;
}

// The R-row group for super-block formats: each row's scales decoded once per super-block
// (one vector), then its four pairs as in q8_row_group, in the same order and arithmetic.
template <class D, int NV, int R, int L>
void q8_super_group(const uint8_t* row, int64_t row_bytes, int64_t nb, const int8_t* const* xq,
                    const float* const* xdl, const int32_t* const* xgb, float* res,
                    int64_t ahead) {
  constexpr int64_t kSuperBytes = D::kSuperBytes;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const char* pf = (const char*)row + ahead;
  const char* pf_to = pf;
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    for (pf_to += kSuperBytes * R; pf < pf_to; pf += 64) prefetch(pf, L);
    const uint8_t* p[R];
    __m512 s[R];
    for (int r = 0; r < R; ++r) {
      p[r] = row + r * row_bytes + sb * kSuperBytes;
      s[r] = super_scales<D>(p[r]);
    }
    auto one_pair = [&](auto K) {
      __m512i w[R];
      __m512 ws[R], wm[R];
      for (int r = 0; r < R; ++r) super_pair<D, K>(p[r], s[r], w[r], ws[r], wm[r]);
      pair_dots<D, NV, R>(w, ws, wm, sb * 8 + 2 * K, xq, xdl, xgb, acc);
    };
    one_pair(std::integral_constant<int, 0>{});
    one_pair(std::integral_constant<int, 1>{});
    one_pair(std::integral_constant<int, 2>{});
    one_pair(std::integral_constant<int, 3>{});
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) res[r * NV + v] = _mm512_reduce_add_ps(acc[r][v]);
}

template <class D, int NV>
void q8_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
             const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const int8_t* xq[NV];
  const float* xdl[NV];
  const int32_t* xgb[NV];
  for (int v = 0; v < NV; ++v) {
    int64_t i = vidx ? vidx[v0 + v] : v0 + v;
    xq[v] = a.q + i * a.K;
    xdl[v] = a.dl + i * (a.K / 4);
    xgb[v] = a.gb + i * (a.K / 4);
  }
  const int64_t ahead = group_lead(prefetch_bytes(), group_rows(NV) * m.row_bytes);
  const int level = prefetch_level();
  prefetch_start(m.data + r0 * m.row_bytes, (r1 - r0) * m.row_bytes, ahead, level);
  with_level(level, [&](auto L) {
    for_row_groups<NV>(m, r0, r1, v0, out, ldo, [&](const uint8_t* row, auto R, float* res) {
      if constexpr (D::kSuper)
        q8_super_group<D, NV, R, L>(row, m.row_bytes, cols / 32, xq, xdl, xgb, res, ahead);
      else
        q8_row_group<D, NV, R, L>(row, m.row_bytes, cols / 32, xq, xdl, xgb, res, ahead,
                                  apart_at(m, row, std::is_same_v<D, q8::NVFP4>));
    });
  });
}

template <class D>
void gemv_q8(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
             const int32_t* vidx, int n, float* out, int64_t ldo) {
  int v0 = 0;
  for (; v0 + 4 <= n; v0 += 4) q8_rows<D, 4>(m, cols, r0, r1, a, vidx, v0, out, ldo);
  switch (n - v0) {
    case 3: q8_rows<D, 3>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 2: q8_rows<D, 2>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 1: q8_rows<D, 1>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
  }
}

// The batched kernel (BatchFn) without AMX: a panel's 16 rows are one vector of bytes per
// group of 4 columns, so each vector's 4 activation bytes (moved to x + 128, unsigned) meet
// all 16 rows in one vpdpbusd, the sum starting from -128 * qsum.
template <int NT>
static inline void batch_vectors(const Panel& p, const Act& a, int64_t m0, float* out,
                                 int64_t ldo) {
  const int64_t K = a.K;
  const int sub = p.sub;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < p.nsub; ++s) {
    const __m512i bias = _mm512_slli_epi32(_mm512_loadu_si512(p.qsum + s * kPanelRows), 7);
    __m512i dot[NT];
    for (int t = 0; t < NT; ++t) dot[t] = _mm512_sub_epi32(_mm512_setzero_si512(), bias);
    const int8_t* qs = p.q + s * sub * kPanelRows;
    for (int k = 0; k < sub / 4; ++k) {
      __m512i w = _mm512_loadu_si512(qs + 64 * k);
      for (int t = 0; t < NT; ++t) {
        __m512i x = _mm512_xor_si512(
            _mm512_set1_epi32((int)load_u32((const uint8_t*)(a.q + (m0 + t) * K + s * sub +
                                                              4 * k))),
            flip);
        dot[t] = _mm512_dpbusd_epi32(dot[t], x, w);
      }
    }
    const __m512 sc = _mm512_loadu_ps(p.scale + s * kPanelRows);
    for (int t = 0; t < NT; ++t) {
      float d = a.d[(m0 + t) * (K / 32) + s * sub / 32];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(sc, _mm512_set1_ps(d)),
                               acc[t]);
      if (p.min)
        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(p.min + s * kPanelRows),
                                 _mm512_set1_ps(-(d * (float)act_sum(a, m0 + t, s, sub))), acc[t]);
    }
  }
  const __mmask16 valid = (__mmask16)((1u << p.rows) - 1);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + (m0 + t) * ldo, valid, acc[t]);
}

void batch_q8(const Panel& p, const Act& a, int M, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) batch_vectors<4>(p, a, m, out, ldo);
  for (; m < M; ++m) batch_vectors<1>(p, a, m, out, ldo);
}

}  // namespace

void register_avx512_vnni(KernelTable& t) {
  for (int f : {F_Q8_0, F_Q4_0, F_Q5_0, F_Q4_K, F_Q5_K, F_Q6_K, F_MXFP4})
    t.batch[f][ISA_AVX512_VNNI] = batch_q8;
  t.fn[F_Q8_0][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q8_0>;
  t.fn[F_Q4_0][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q4_0>;
  t.fn[F_Q5_0][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q5_0>;
  t.fn[F_MXFP4][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::MXFP4>;
  t.fn[F_NVFP4][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::NVFP4>;
  t.fn[F_Q4_K][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q4_K>;
  t.fn[F_Q5_K][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q5_K>;
  t.fn[F_Q6_K][ACT_Q8][ISA_AVX512_VNNI] = gemv_q8<q8::Q6_K>;
}

}  // namespace ft
