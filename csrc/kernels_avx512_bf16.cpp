// AVX512-BF16 tier: bf16 weights with bf16 activations, 32 products per vdpbf16ps.
#include <immintrin.h>

#include "common.h"
#include "prefetch.h"

namespace ft {
namespace {

template <int NV>
void bf16_rows(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
               const int32_t* vidx, int v0, float* out, int64_t ldo) {
  const uint16_t* x[NV];
  for (int v = 0; v < NV; ++v) x[v] = a.bf + (vidx ? vidx[v0 + v] : v0 + v) * a.K;
  const int64_t ahead = prefetch_bytes();
  const int level = prefetch_level();
  prefetch_start(m.data + r0 * m.row_bytes, (r1 - r0) * m.row_bytes, ahead);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* w = (const uint16_t*)(m.data + r * m.row_bytes);
    __m512 acc[NV][2];
    for (int v = 0; v < NV; ++v) acc[v][0] = acc[v][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= cols; i += 64) {
      prefetch((const char*)(w + i) + ahead, level);
      prefetch((const char*)(w + i) + ahead + 64, level);
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i);
      __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
      for (int v = 0; v < NV; ++v) {
        acc[v][0] = _mm512_dpbf16_ps(acc[v][0], w0, (__m512bh)_mm512_loadu_si512(x[v] + i));
        acc[v][1] =
            _mm512_dpbf16_ps(acc[v][1], w1, (__m512bh)_mm512_loadu_si512(x[v] + i + 32));
      }
    }
    for (; i < cols; i += 32) {
      __mmask32 k = cols - i >= 32 ? 0xFFFFFFFFu : (1u << (cols - i)) - 1;
      __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(k, w + i);
      for (int v = 0; v < NV; ++v)
        acc[v][0] =
            _mm512_dpbf16_ps(acc[v][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(k, x[v] + i));
    }
    for (int v = 0; v < NV; ++v)
      out[(int64_t)(v0 + v) * ldo + (r - r0)] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[v][0], acc[v][1]));
  }
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
