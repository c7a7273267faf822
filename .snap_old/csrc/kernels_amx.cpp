// AMX tier of the batched kernels: a tile of up to 16 vectors' int8 activations (one
// sub-block wide) times a panel's sub-block (16 rows) is one tdpbssd into 16 x 16 int32 dot
// products, stored and turned into floats in the reference's order (BatchFn in common.h). Two
// sub-blocks go through two accumulator tiles per step, so one's dot products overlap the
// other's float work.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <initializer_list>

#include "common.h"
#include "panels.h"

namespace ft {
namespace {

// The layout _tile_loadconfig reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: dot products (mr x 16 int32); 2, 3: activations (mr x sub bytes); 4, 5: the
// panel's sub-blocks (sub / 4 rows of 16 x 4 bytes).
static void configure(int mr, int sub) {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = (uint8_t)mr;
    c.colsb[t] = 64;
    c.rows[2 + t] = (uint8_t)mr;
    c.colsb[2 + t] = (uint16_t)sub;
    c.rows[4 + t] = (uint8_t)(sub / 4);
    c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// acc[m] += sub-block s's dot products c (mr x 16) in floats.
template <bool kFull>
static inline void finish(const Panel& p, const Act& a, int64_t m0, int mr, int64_t s,
                          const int32_t* c, __m512* acc) {
  const int n = kFull ? kPanelRows : mr;
  const __m512 sc = _mm512_loadu_ps(p.scale + s * kPanelRows);
  const float* d = a.d + m0 * (a.K / 32) + s * p.sub / 32;
  for (int m = 0; m < n; ++m) {
    float dm = d[m * (a.K / 32)];
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)),
                             _mm512_mul_ps(sc, _mm512_set1_ps(dm)), acc[m]);
    if (p.min)
      acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(p.min + s * kPanelRows),
                               _mm512_set1_ps(-(dm * (float)act_sum(a, m0 + m, s, p.sub))),
                               acc[m]);
  }
}

template <bool kFull>
static void tile_vectors(const Panel& p, const Act& a, int64_t m0, int mr, float* out,
                         int64_t ldo) {
  alignas(64) int32_t c[2][kPanelRows * 16];
  __m512 acc[kPanelRows];
  for (int m = 0; m < kPanelRows; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t K = a.K;
  const int sub = p.sub;
  const int8_t* x = a.q + m0 * K;
  const int64_t step = (int64_t)sub * kPanelRows;  // panel bytes per sub-block
  int64_t s = 0;
  for (; s + 2 <= p.nsub; s += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, x + s * sub, K);
    _tile_loadd(4, p.q + s * step, 64);
    _tile_loadd(3, x + (s + 1) * sub, K);
    _tile_loadd(5, p.q + (s + 1) * step, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 5);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    finish<kFull>(p, a, m0, mr, s, c[0], acc);
    finish<kFull>(p, a, m0, mr, s + 1, c[1], acc);
  }
  if (s < p.nsub) {
    _tile_zero(0);
    _tile_loadd(2, x + s * sub, K);
    _tile_loadd(4, p.q + s * step, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_stored(0, c[0], 64);
    finish<kFull>(p, a, m0, mr, s, c[0], acc);
  }
  const __mmask16 valid = (__mmask16)((1u << p.rows) - 1);
  for (int m = 0; m < mr; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * ldo, valid, acc[m]);
}

void batch_amx(const Panel& p, const Act& a, int M, float* out, int64_t ldo) {
  int64_t m = 0;
  if (M >= kPanelRows) {
    configure(kPanelRows, p.sub);
    for (; m + kPanelRows <= M; m += kPanelRows)
      tile_vectors<true>(p, a, m, kPanelRows, out, ldo);
  }
  if (m < M) {
    configure((int)(M - m), p.sub);
    tile_vectors<false>(p, a, m, (int)(M - m), out, ldo);
  }
  _tile_release();
}

// AMX-TILE and AMX-INT8 in CPUID, and the OS's leave to use the tile data (Linux asks for it
// once per process).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace

void register_amx(KernelTable& t) {
  if (!amx_usable()) return;
  for (int f : {F_Q8_0, F_Q4_0, F_Q5_0, F_Q4_K, F_Q5_K, F_Q6_K, F_MXFP4})
    t.batch[f][ISA_AVX512_BF16] = batch_amx;
}

}  // namespace ft
