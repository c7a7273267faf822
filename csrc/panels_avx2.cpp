// AVX2 tier's panel decoders (PanelFn, panels.h): a dense matrix's rows decoded for the
// batched kernels from the int8 row kernels' block decoders (q8_blocks.h), with the bits of
// the reference decode_panel.
#include <immintrin.h>

#include "common.h"
#include "panels.h"
#include "q8_blocks.h"

namespace ft {
namespace {

// Panel decoders (PanelFn) from the row kernels' block decoders: each 32-weight block's
// quants with the offset removed, spread a dword per panel row, and its scale (and min) from
// the same products as the reference's.
static inline void put_block(__m256i w, int64_t b, int n, int32_t* q, int32_t* qsum_at) {
  alignas(32) int32_t d[8];
  _mm256_store_si256((__m256i*)d, w);
  for (int j = 0; j < 8; ++j) q[panel_dword(b, j, n)] = d[j];
  __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), w),
                                _mm256_set1_epi16(1));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  *qsum_at = _mm_cvtsi128_si32(h);
}

// The signed sum of 16 of w's bytes (half 0 or 1).
static inline int32_t half_sum(__m256i w, int half) {
  __m128i v = half ? _mm256_extracti128_si256(w, 1) : _mm256_castsi256_si128(w);
  __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), v), _mm_set1_epi16(1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <class D>
void panel_blocks(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
                  Panel* p) {
  panel_view(fmt, rows, cols, buf, p);
  int32_t* q = (int32_t*)buf.q.data();
  for (int n = 0; n < rows; ++n) {
    const uint8_t* row = m.data + (r0 + n) * m.row_bytes;
    for (int64_t b = 0; b < cols / 32; ++b) {
      __m256i w;
      __m256 ws, wm = _mm256_setzero_ps();
      D::block(row, b, w, ws, wm);
      if (!D::kSigned) w = _mm256_sub_epi8(w, _mm256_set1_epi8((char)D::kOff));
      put_block(w, b, n, q, &buf.qsum[b * kPanelRows + n]);
      buf.scale[b * kPanelRows + n] = _mm256_cvtss_f32(ws);
    }
  }
}

// q4_k and q5_k: 32-weight sub-blocks with a scale and a min each.
template <class D, int K>
static inline void k_pair(const uint8_t* sb, int64_t b, int n, float* sc, float* mn,
                          PanelBuf& buf, int32_t* q) {
  __m256i w0, w1;
  D::template pair_quants<K>(sb, w0, w1);
  put_block(w0, b + 2 * K, n, q, &buf.qsum[(b + 2 * K) * kPanelRows + n]);
  put_block(w1, b + 2 * K + 1, n, q, &buf.qsum[(b + 2 * K + 1) * kPanelRows + n]);
  for (int j = 2 * K; j < 2 * K + 2; ++j) {
    buf.scale[(b + j) * kPanelRows + n] = sc[j];
    buf.min[(b + j) * kPanelRows + n] = mn[j];
  }
}

template <class D>
void panel_k(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
             Panel* p) {
  panel_view(fmt, rows, cols, buf, p);
  int32_t* q = (int32_t*)buf.q.data();
  for (int n = 0; n < rows; ++n) {
    const uint8_t* row = m.data + (r0 + n) * m.row_bytes;
    for (int64_t u = 0; u < cols / 256; ++u) {
      const uint8_t* sb = row + u * D::kSuperBytes;
      alignas(32) float sc[8], mn[8];
      __m256 vs, vm;
      D::super_scales(sb, vs, vm);
      _mm256_store_ps(sc, vs);
      _mm256_store_ps(mn, vm);
      k_pair<D, 0>(sb, 8 * u, n, sc, mn, buf, q);
      k_pair<D, 1>(sb, 8 * u, n, sc, mn, buf, q);
      k_pair<D, 2>(sb, 8 * u, n, sc, mn, buf, q);
      k_pair<D, 3>(sb, 8 * u, n, sc, mn, buf, q);
    }
  }
}

// q6_k's sub-blocks are 16 weights: block b's halves are sub-blocks 2b and 2b + 1.
template <int K>
static inline void q6_k_pair(const uint8_t* sb, int64_t b, int n, const float* sc,
                             PanelBuf& buf, int32_t* q) {
  __m256i w[2];
  q8::Q6_K::pair_quants<K>(sb, w[0], w[1]);
  for (int i = 0; i < 2; ++i) {
    __m256i v = _mm256_sub_epi8(w[i], _mm256_set1_epi8(32));
    const int64_t blk = b + 2 * K + i;
    alignas(32) int32_t d[8];
    _mm256_store_si256((__m256i*)d, v);
    for (int j = 0; j < 8; ++j) q[panel_dword(blk, j, n)] = d[j];
    for (int h = 0; h < 2; ++h) {
      buf.qsum[(2 * blk + h) * kPanelRows + n] = half_sum(v, h);
      buf.scale[(2 * blk + h) * kPanelRows + n] = sc[4 * K + 2 * i + h];
    }
  }
}

void panel_q6_k(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
                Panel* p) {
  panel_view(fmt, rows, cols, buf, p);
  int32_t* q = (int32_t*)buf.q.data();
  for (int n = 0; n < rows; ++n) {
    const uint8_t* row = m.data + (r0 + n) * m.row_bytes;
    for (int64_t u = 0; u < cols / 256; ++u) {
      const uint8_t* sb = row + u * q8::Q6_K::kSuperBytes;
      alignas(32) float sc[16];
      __m256 lo, hi;
      q8::Q6_K::super_scales(sb, lo, hi);
      _mm256_store_ps(sc, lo);
      _mm256_store_ps(sc + 8, hi);
      q6_k_pair<0>(sb, 8 * u, n, sc, buf, q);
      q6_k_pair<1>(sb, 8 * u, n, sc, buf, q);
      q6_k_pair<2>(sb, 8 * u, n, sc, buf, q);
      q6_k_pair<3>(sb, 8 * u, n, sc, buf, q);
    }
  }
}

}  // namespace

void register_panels_avx2(PanelFn* fns) {
  fns[F_Q8_0] = panel_blocks<q8::Q8_0>;
  fns[F_Q4_0] = panel_blocks<q8::Q4_0>;
  fns[F_Q5_0] = panel_blocks<q8::Q5_0>;
  fns[F_MXFP4] = panel_blocks<q8::MXFP4>;
  fns[F_Q4_K] = panel_k<q8::Q4_K>;
  fns[F_Q5_K] = panel_k<q8::Q5_K>;
  fns[F_Q6_K] = panel_q6_k;
}

}  // namespace ft
