// AVX2 + FMA tier: bf16 and f32 with float activations, int formats with int8 activations
// (maddubs: unsigned weights times signed activations, the sign trick for q8_0), several rows
// per activation load; the batched kernel and the int8 quantiser (its panel decoders:
// panels_avx2.cpp).
#include <immintrin.h>

#include <initializer_list>
#include <type_traits>

#include "common.h"
#include "panels.h"
#include "q8_blocks.h"
#include "row_groups.h"

namespace ft {
namespace {

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Per-row decoders of the float formats: 8 weights at element i, or the one at element k.
struct BF16 {
  static inline __m256 load(const uint8_t* row, int64_t i) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static inline float at(const uint8_t* row, int64_t k) {
    return bf16_to_f32(load_u16(row + 2 * k));
  }
};

struct F32 {
  static inline __m256 load(const uint8_t* row, int64_t i) {
    return _mm256_loadu_ps((const float*)row + i);
  }
  static inline float at(const uint8_t* row, int64_t k) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  }
};

template <class D, int NV>
void f32_row(const uint8_t* w, int64_t cols, const float* const* x, float* res) {
  __m256 acc[NV][2];
  for (int v = 0; v < NV; ++v) acc[v][0] = acc[v][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16) {
    __m256 w0 = D::load(w, i), w1 = D::load(w, i + 8);
    for (int v = 0; v < NV; ++v) {
      acc[v][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[v] + i), acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[v] + i + 8), acc[v][1]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    float s = hsum(_mm256_add_ps(acc[v][0], acc[v][1]));
    for (int64_t k = i; k < cols; ++k) s += D::at(w, k) * x[v][k];
    res[v] = s;
  }
}

// acc[r][v] += block b of R rows (w, ws, wm) times vector v's activations. The offset and
// the group sums' floats are shared by the rows; each (row, vector) adds in block order with
// the same arithmetic whatever R is, so a row's result has the same bits in every group.
template <class D, int NV, int R>
static inline void block_dots(const __m256i* w, const __m256* ws, const __m256* wm, int64_t b,
                              const int8_t* const* xq, const float* const* xdl,
                              const int32_t* const* xgs, __m256 (*acc)[NV]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i wa[R];
  for (int r = 0; r < R; ++r) wa[r] = D::kSigned ? _mm256_sign_epi8(w[r], w[r]) : w[r];
  for (int v = 0; v < NV; ++v) {
    __m256i x = _mm256_loadu_si256((const __m256i*)(xq[v] + 32 * b));
    __m256i gs = _mm256_setzero_si256();
    if (D::kOff || D::kMins) gs = _mm256_loadu_si256((const __m256i*)(xgs[v] + 8 * b));
    __m256i off = D::kOff ? q8::mul_const<D::kOff>(gs) : gs;
    __m256 fgs = D::kMins ? _mm256_cvtepi32_ps(gs) : _mm256_setzero_ps();
    __m256 dl = _mm256_loadu_ps(xdl[v] + 8 * b);
    for (int r = 0; r < R; ++r) {
      __m256i xs = D::kSigned ? _mm256_sign_epi8(x, w[r]) : x;
      __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[r], xs), ones);
      if (D::kOff) dot = _mm256_sub_epi32(dot, off);
      acc[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), ws[r]), dl, acc[r][v]);
      if (D::kMins) acc[r][v] = _mm256_fnmadd_ps(_mm256_mul_ps(fgs, wm[r]), dl, acc[r][v]);
    }
  }
}

// Block j's scales (8 lanes) from a super-block's: q4_k and q5_k (the formats with mins) one
// per 32-weight sub-block (sc, mn), q6_k one per 16 weights (lo: groups 0-7, hi: 8-15).
template <class D, int J>
static inline void block_scales(__m256 a, __m256 c, __m256& ws, __m256& wm) {
  if constexpr (D::kMins) {
    ws = _mm256_permutevar8x32_ps(a, _mm256_set1_epi32(J));
    wm = _mm256_permutevar8x32_ps(c, _mm256_set1_epi32(J));
  } else {
    constexpr int g = 2 * (J % 4);
    const __m256i idx = _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1);
    ws = _mm256_permutevar8x32_ps(J < 4 ? a : c, idx);
  }
}

// R consecutive rows at once (see row_groups.h), prefetched linearly `ahead` of what has
// been read of the group; super-block formats decode each row's scales once per super-block
// and two blocks' quants at a time.
template <class D, int NV, int R, int L>
void q8_group(const uint8_t* row, int64_t row_bytes, int64_t nb, const int8_t* const* xq,
              const float* const* xdl, const int32_t* const* xgs, float* res, int64_t ahead,
              const Apart& apart) {
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const char* pf = (const char*)row + ahead;
  const char* pf_to = pf;
  if constexpr (D::kSuper) {
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      for (pf_to += D::kSuperBytes * R; pf < pf_to; pf += 64) prefetch(pf, L);
      const uint8_t* p[R];
      __m256 sa[R], sc[R];
      for (int r = 0; r < R; ++r) {
        p[r] = row + r * row_bytes + sb * D::kSuperBytes;
        D::super_scales(p[r], sa[r], sc[r]);
      }
      auto one_pair = [&](auto K) {
        __m256i w0[R], w1[R];
        __m256 ws[R], wm[R];
        for (int r = 0; r < R; ++r) D::template pair_quants<K>(p[r], w0[r], w1[r]);
        for (int r = 0; r < R; ++r) block_scales<D, 2 * K>(sa[r], sc[r], ws[r], wm[r]);
        block_dots<D, NV, R>(w0, ws, wm, sb * 8 + 2 * K, xq, xdl, xgs, acc);
        for (int r = 0; r < R; ++r) block_scales<D, 2 * K + 1>(sa[r], sc[r], ws[r], wm[r]);
        block_dots<D, NV, R>(w1, ws, wm, sb * 8 + 2 * K + 1, xq, xdl, xgs, acc);
      };
      one_pair(std::integral_constant<int, 0>{});
      one_pair(std::integral_constant<int, 1>{});
      one_pair(std::integral_constant<int, 2>{});
      one_pair(std::integral_constant<int, 3>{});
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      for (pf_to += D::kBlockBytes * R; pf < pf_to; pf += 64) prefetch(pf, L);
      __m256i w[R];
      __m256 ws[R], wm[R];
      for (int r = 0; r < R; ++r) {
        wm[r] = _mm256_setzero_ps();
        q8::block_at<D>(row + r * row_bytes, apart.scales + r * apart.scale_row_bytes, b, w[r],
                        ws[r], wm[r]);
      }
      block_dots<D, NV, R>(w, ws, wm, b, xq, xdl, xgs, acc);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) res[r * NV + v] = hsum(acc[r][v]) * apart.scale2;
}

template <class D, int NV>
void f32_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
              const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const float* x[NV];
  for (int v = 0; v < NV; ++v) x[v] = a.f + (vidx ? vidx[v0 + v] : v0 + v) * a.K;
  float res[NV];
  for (int64_t r = r0; r < r1; ++r) {
    f32_row<D, NV>(m.data + r * m.row_bytes, cols, x, res);
    for (int v = 0; v < NV; ++v) out[(int64_t)(v0 + v) * ldo + (r - r0)] = res[v];
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

template <class D, int NV>
void q8_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
             const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const int8_t* xq[NV];
  const float* xdl[NV];
  const int32_t* xgs[NV];
  for (int v = 0; v < NV; ++v) {
    int64_t i = vidx ? vidx[v0 + v] : v0 + v;
    xq[v] = a.q + i * a.K;
    xdl[v] = a.dl + i * (a.K / 4);
    xgs[v] = a.gs + i * (a.K / 4);
  }
  const int64_t ahead = group_lead(prefetch_bytes(), group_rows(NV) * m.row_bytes);
  const int level = prefetch_level();
  prefetch_start(m.data + r0 * m.row_bytes, (r1 - r0) * m.row_bytes, ahead, level);
  with_level(level, [&](auto L) {
    for_row_groups<NV>(m, r0, r1, v0, out, ldo, [&](const uint8_t* row, auto R, float* res) {
      q8_group<D, NV, R, L>(row, m.row_bytes, cols / 32, xq, xdl, xgs, res, ahead,
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

uint64_t read_avx2(const uint8_t* p, int64_t bytes) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
  for (int64_t i = 0; i < bytes; i += 64) {
    acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256((const __m256i*)(p + i)));
    acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
  }
  acc0 = _mm256_xor_si256(acc0, acc1);
  return (uint64_t)_mm256_extract_epi64(acc0, 0) ^ (uint64_t)_mm256_extract_epi64(acc0, 3);
}

// The batched kernel (BatchFn): NT vectors at a time against a panel's 16 rows (two vectors
// of 8). maddubs multiplies unsigned by signed bytes: the activations are moved to x + 128 and
// 128 * qsum taken back out, or, for q8_0's full-range weights (kWide), |q| meets x with q's
// sign. G groups of 4 columns are summed in int16 before widening: G * 2 * 255 * max|q| stays
// below 2^15, so the sums are exact.
template <bool kWide, int G, int NT, int sub>
static inline void batch_vectors(const Panel& p, const Act& a, int64_t m0, float* out,
                                 int64_t ldo) {
  const int64_t K = a.K;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < p.nsub; ++s) {
    __m256i dot[NT][2];
    for (int t = 0; t < NT; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
    const int8_t* qs = p.q + s * sub * kPanelRows;
    for (int k0 = 0; k0 < sub / 4; k0 += G) {
      __m256i h[NT][2];
      for (int t = 0; t < NT; ++t) h[t][0] = h[t][1] = _mm256_setzero_si256();
      for (int k = k0; k < k0 + G; ++k) {
        __m256i w0 = _mm256_loadu_si256((const __m256i*)(qs + 64 * k));
        __m256i w1 = _mm256_loadu_si256((const __m256i*)(qs + 64 * k + 32));
        __m256i u0 = kWide ? _mm256_abs_epi8(w0) : w0, u1 = kWide ? _mm256_abs_epi8(w1) : w1;
        for (int t = 0; t < NT; ++t) {
          __m256i x = _mm256_set1_epi32((int)load_u32((const uint8_t*)(a.q + (m0 + t) * K +
                                                                       s * sub + 4 * k)));
          if (kWide) {
            h[t][0] = _mm256_add_epi16(h[t][0], _mm256_maddubs_epi16(u0, _mm256_sign_epi8(x, w0)));
            h[t][1] = _mm256_add_epi16(h[t][1], _mm256_maddubs_epi16(u1, _mm256_sign_epi8(x, w1)));
          } else {
            x = _mm256_xor_si256(x, flip);
            h[t][0] = _mm256_add_epi16(h[t][0], _mm256_maddubs_epi16(x, w0));
            h[t][1] = _mm256_add_epi16(h[t][1], _mm256_maddubs_epi16(x, w1));
          }
        }
      }
      for (int t = 0; t < NT; ++t) {
        dot[t][0] = _mm256_add_epi32(dot[t][0], _mm256_madd_epi16(h[t][0], ones));
        dot[t][1] = _mm256_add_epi32(dot[t][1], _mm256_madd_epi16(h[t][1], ones));
      }
    }
    const float* sc = p.scale + s * kPanelRows;
    __m256 sc0 = _mm256_loadu_ps(sc), sc1 = _mm256_loadu_ps(sc + 8);
    __m256i b0 = _mm256_setzero_si256(), b1 = b0;
    if (!kWide) {
      b0 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(p.qsum + s * kPanelRows)), 7);
      b1 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(p.qsum + s * kPanelRows + 8)),
                             7);
    }
    for (int t = 0; t < NT; ++t) {
      float d = a.d[(m0 + t) * (K / 32) + s * sub / 32];
      __m256 sd0 = _mm256_mul_ps(sc0, _mm256_set1_ps(d)), sd1 = _mm256_mul_ps(sc1, _mm256_set1_ps(d));
      acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[t][0], b0)), sd0,
                                  acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[t][1], b1)), sd1,
                                  acc[t][1]);
      if (p.min) {
        __m256 nds = _mm256_set1_ps(-(d * (float)act_sum(a, m0 + t, s, sub)));
        acc[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(p.min + s * kPanelRows), nds, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(p.min + s * kPanelRows + 8), nds, acc[t][1]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    float* o = out + (m0 + t) * ldo;
    if (p.rows == kPanelRows) {
      _mm256_storeu_ps(o, acc[t][0]);
      _mm256_storeu_ps(o + 8, acc[t][1]);
    } else {
      alignas(32) float row[kPanelRows];
      _mm256_store_ps(row, acc[t][0]);
      _mm256_store_ps(row + 8, acc[t][1]);
      for (int n = 0; n < p.rows; ++n) o[n] = row[n];
    }
  }
}

// G per format from its largest |q| (q8_0: 128, one group at a time).
template <bool kWide, int G, int sub>
void batch_sub(const Panel& p, const Act& a, int M, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) batch_vectors<kWide, G, 2, sub>(p, a, m, out, ldo);
  if (m < M) batch_vectors<kWide, G, 1, sub>(p, a, m, out, ldo);
}

template <bool kWide, int G>
void batch_q8(const Panel& p, const Act& a, int M, float* out, int64_t ldo) {
  if (p.sub == 16)
    batch_sub<kWide, G, 16>(p, a, M, out, ldo);
  else
    batch_sub<kWide, G, 32>(p, a, M, out, ldo);
}

// quantize_q8 eight lanes at a time, with its bits: the same max, scale, round-to-nearest-even
// and clamp; the int32 values packed to bytes in order (packs interleave 128-bit lanes, one
// permute puts them back), group sums of four through maddubs/madd.
void quantize_q8_avx2(const float* x, int64_t K, int8_t* q, float* d, float* dl, int32_t* gs,
                      int32_t* gb) {
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f),
               lo = _mm256_set1_ps(-127.0f);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    float db = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = db;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      n[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    __m256i qb = _mm256_permutevar8x32_epi32(w, order);
    _mm256_storeu_si256((__m256i*)(q + 32 * b), qb);
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qb), ones16);
    _mm256_storeu_si256((__m256i*)(gs + 8 * b), s);
    _mm256_storeu_si256((__m256i*)(gb + 8 * b), _mm256_mullo_epi32(s, _mm256_set1_epi32(-128)));
    _mm256_storeu_ps(dl + 8 * b, _mm256_set1_ps(db));
  }
}

}  // namespace

void register_avx2(KernelTable& t) {
  t.quant[ISA_AVX2] = quantize_q8_avx2;
  t.batch[F_Q8_0][ISA_AVX2] = batch_q8<true, 1>;
  t.batch[F_Q4_0][ISA_AVX2] = batch_q8<false, 8>;   // |q| <= 8
  t.batch[F_Q5_0][ISA_AVX2] = batch_q8<false, 4>;   // 16
  t.batch[F_Q4_K][ISA_AVX2] = batch_q8<false, 4>;   // 15
  t.batch[F_Q5_K][ISA_AVX2] = batch_q8<false, 2>;   // 31
  t.batch[F_MXFP4][ISA_AVX2] = batch_q8<false, 4>;  // 12
  t.batch[F_Q6_K][ISA_AVX2] = batch_q8<false, 2>;   // 32
  t.fn[F_BF16][ACT_F32][ISA_AVX2] = gemv_f32<BF16>;
  t.fn[F_F32][ACT_F32][ISA_AVX2] = gemv_f32<F32>;
  t.fn[F_Q8_0][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q8_0>;
  t.fn[F_Q4_0][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q4_0>;
  t.fn[F_Q5_0][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q5_0>;
  t.fn[F_MXFP4][ACT_Q8][ISA_AVX2] = gemv_q8<q8::MXFP4>;
  t.fn[F_NVFP4][ACT_Q8][ISA_AVX2] = gemv_q8<q8::NVFP4>;
  t.fn[F_Q4_K][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q4_K>;
  t.fn[F_Q5_K][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q5_K>;
  t.fn[F_Q6_K][ACT_Q8][ISA_AVX2] = gemv_q8<q8::Q6_K>;
  t.read[ISA_AVX2] = read_avx2;
}

}  // namespace ft
