// AVX512-BF16 tier: bf16 weights with bf16 activations, 32 products per vdpbf16ps.
#include <immintrin.h>

#include "common.h"
#include "row_groups.h"

namespace ft {
namespace {

// R consecutive rows at once, so each activation load serves R rows; two accumulators per
// (row, vector), for the even and odd 32 columns of each 64, whatever R and NV are (the same
// bits). The group is one region of R rows, prefetched linearly `ahead` of what has been
// read of it; L: the prefetch level.
template <int NV, int R, int L>
void bf16_row_group(const uint16_t* w, int64_t row_elems, int64_t cols, const uint16_t* const* x,
                    float* res, int64_t ahead) {
  __m512 acc[R][NV][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v][0] = acc[r][v][1] = _mm512_setzero_ps();
  const char* pf = (const char*)w + ahead;
  const char* pf_to = pf;
  int64_t i = 0;
  for (; i + 64 <= cols; i += 64) {
    for (pf_to += 128 * R; pf < pf_to; pf += 64) prefetch(pf, L);
    __m512bh w0[R], w1[R];
    for (int r = 0; r < R; ++r) {
      w0[r] = (__m512bh)_mm512_loadu_si512(w + r * row_elems + i);
      w1[r] = (__m512bh)_mm512_loadu_si512(w + r * row_elems + i + 32);
    }
    for (int v = 0; v < NV; ++v) {
      __m512bh x0 = (__m512bh)_mm512_loadu_si512(x[v] + i);
      __m512bh x1 = (__m512bh)_mm512_loadu_si512(x[v] + i + 32);
      for (int r = 0; r < R; ++r) {
        acc[r][v][0] = _mm512_dpbf16_ps(acc[r][v][0], w0[r], x0);
        acc[r][v][1] = _mm512_dpbf16_ps(acc[r][v][1], w1[r], x1);
      }
    }
  }
  for (; i < cols; i += 32) {
    __mmask32 k = cols - i >= 32 ? 0xFFFFFFFFu : (1u << (cols - i)) - 1;
    for (int r = 0; r < R; ++r) {
      __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(k, w + r * row_elems + i);
      for (int v = 0; v < NV; ++v)
        acc[r][v][0] =
            _mm512_dpbf16_ps(acc[r][v][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(k, x[v] + i));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      res[r * NV + v] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][v][0], acc[r][v][1]));
}

template <int NV>
void bf16_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
               const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const uint16_t* x[NV];
  for (int v = 0; v < NV; ++v) x[v] = a.bf + (vidx ? vidx[v0 + v] : v0 + v) * a.K;
  const int64_t ahead = group_lead(prefetch_bytes(), group_rows(NV) * m.row_bytes);
  const int level = prefetch_level();
  prefetch_start(m.data + r0 * m.row_bytes, (r1 - r0) * m.row_bytes, ahead, level);
  const int64_t row_elems = m.row_bytes / 2;
  with_level(level, [&](auto L) {
    for_row_groups<NV>(m, r0, r1, v0, out, ldo, [&](const uint8_t* row, auto R, float* res) {
      bf16_row_group<NV, R, L>((const uint16_t*)row, row_elems, cols, x, res, ahead);
    });
  });
}

void gemv_bf16(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
               const int32_t* vidx, int n, float* out, int64_t ldo) {
  int v0 = 0;
  for (; v0 + 4 <= n; v0 += 4) bf16_rows<4>(m, cols, r0, r1, a, vidx, v0, out, ldo);
  switch (n - v0) {
    case 3: bf16_rows<3>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 2: bf16_rows<2>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
    case 1: bf16_rows<1>(m, cols, r0, r1, a, vidx, v0, out, ldo); break;
  }
}

}  // namespace

void register_avx512_bf16(KernelTable& t) {
  t.fn[F_BF16][ACT_BF16][ISA_AVX512_BF16] = gemv_bf16;
}

}  // namespace ft
