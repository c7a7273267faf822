// Scalar reference kernels: the slow twin of every ISA override. Each format decodes one unit
// of a row into floats (F32 activations, the torch reference's arithmetic) or into small
// integers with per-16 scales and mins (Q8 activations: w = s * q - m); the batched kernels'
// reference reads those integers from a panel.
#include <cmath>
#include <initializer_list>

#include "common.h"

namespace ft {
namespace {

constexpr int kMaxUnit = 256;

// Elements per decoding unit of each format: its block, and 32 for the plain floats (the last
// unit of a bf16/f32/fp8 row may be partial).
constexpr int unit_of(int fmt) { return FMT_INFO[fmt].block > 1 ? FMT_INFO[fmt].block : 32; }

// The head of a q4_k or q5_k super-block b: d * scale and dmin * min of each 32-weight
// sub-block, once per 16 weights.
void k_scales(const uint8_t* b, float* s, float* mn) {
  float d = fp16_to_f32(load_u16(b)), dmin = fp16_to_f32(load_u16(b + 2));
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mv;
    q4k_scale_min(b + 4, j, &sc, &mv);
    s[2 * j] = s[2 * j + 1] = d * sc;
    mn[2 * j] = mn[2 * j + 1] = dmin * mv;
  }
}

}  // namespace

void decode_int(int fmt, const Mat& m, int64_t r, int64_t u, int16_t* q, float* s, float* mn) {
  const uint8_t* row = m.data + r * m.row_bytes;
  switch (fmt) {
    case F_Q8_0: {
      const uint8_t* b = row + u * FMT_INFO[F_Q8_0].block_bytes;
      float d = fp16_to_f32(load_u16(b));
      for (int i = 0; i < 32; ++i) q[i] = (int8_t)b[2 + i];
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0;
      return;
    }
    case F_Q4_0: {
      const uint8_t* b = row + u * FMT_INFO[F_Q4_0].block_bytes;
      float d = fp16_to_f32(load_u16(b));
      for (int i = 0; i < 16; ++i) {
        q[i] = (int16_t)((b[2 + i] & 15) - 8);
        q[i + 16] = (int16_t)((b[2 + i] >> 4) - 8);
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0;
      return;
    }
    case F_Q5_0: {
      const uint8_t* b = row + u * FMT_INFO[F_Q5_0].block_bytes;
      float d = fp16_to_f32(load_u16(b));
      uint32_t qh = load_u32(b + 2);
      for (int i = 0; i < 16; ++i) {
        q[i] = (int16_t)(((b[6 + i] & 15) | ((qh >> i) & 1) << 4) - 16);
        q[i + 16] = (int16_t)(((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0;
      return;
    }
    case F_MXFP4: {
      const uint8_t* b = row + u * FMT_INFO[F_MXFP4].block_bytes;
      float d = e8m0_half(b[0]);
      for (int i = 0; i < 16; ++i) {
        q[i] = kE2M1Doubled[b[1 + i] & 15];
        q[i + 16] = kE2M1Doubled[b[1 + i] >> 4];
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0;
      return;
    }
    case F_Q4_K: {
      const uint8_t* b = row + u * FMT_INFO[F_Q4_K].block_bytes;
      k_scales(b, s, mn);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qs = b + 16 + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) q[32 * j + l] = (int16_t)((qs[l] >> (4 * (j & 1))) & 15);
      }
      return;
    }
    case F_Q5_K: {  // q4_k's quants plus 16 where bit j of qh[l] is set (weight l, sub-block j)
      const uint8_t* b = row + u * FMT_INFO[F_Q5_K].block_bytes;
      const uint8_t *qh = b + 16, *ql = b + 48;
      k_scales(b, s, mn);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qs = ql + 32 * (j / 2);
        for (int l = 0; l < 32; ++l)
          q[32 * j + l] = (int16_t)(((qs[l] >> (4 * (j & 1))) & 15) | ((qh[l] >> j) & 1) << 4);
      }
      return;
    }
    case F_Q6_K: {
      const uint8_t* b = row + u * FMT_INFO[F_Q6_K].block_bytes;
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      float d = fp16_to_f32(load_u16(b + 208));
      for (int g = 0; g < 16; ++g) {
        s[g] = d * sc[g];
        mn[g] = 0;
      }
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l) {
            int lo = (ql[64 * h + l + 32 * (k & 1)] >> (4 * (k >> 1))) & 15;
            int hi = (qh[32 * h + l] >> (2 * k)) & 3;
            q[128 * h + 32 * k + l] = (int16_t)((lo | hi << 4) - 32);
          }
      return;
    }
    case F_NVFP4: {
      const uint8_t* b = row + u * FMT_INFO[F_NVFP4].block_bytes;
      s[0] = e4m3_to_f32(m.scale[r * m.scale_row_bytes + u]) * 0.5f;
      mn[0] = 0;
      for (int i = 0; i < 8; ++i) {
        q[2 * i] = kE2M1Doubled[b[i] & 15];
        q[2 * i + 1] = kE2M1Doubled[b[i] >> 4];
      }
      return;
    }
    default:
      return;
  }
}

namespace {

// Float decoding of unit u of row r (n valid elements), matching the torch references.
void decode_f32(int fmt, const Mat& m, int64_t r, int64_t u, int n, float* w) {
  const uint8_t* row = m.data + r * m.row_bytes;
  if (fmt == F_BF16) {
    for (int i = 0; i < n; ++i) w[i] = bf16_to_f32(load_u16(row + 2 * (u * 32 + i)));
    return;
  }
  if (fmt == F_F32) {
    std::memcpy(w, row + 4 * u * 32, 4 * (size_t)n);
    return;
  }
  if (fmt == F_FP8_BLOCK) {
    const float* srow = (const float*)(m.scale + (r / 128) * m.scale_row_bytes);
    for (int i = 0; i < n; ++i) {
      int64_t c = u * 32 + i;
      w[i] = e4m3_to_f32(row[c]) * srow[c / 128];
    }
    return;
  }
  if (fmt == F_NVFP4) {
    float ws = e4m3_to_f32(m.scale[r * m.scale_row_bytes + u]);
    const uint8_t* b = row + u * 8;
    for (int i = 0; i < 16; ++i) {
      float v = 0.5f * kE2M1Doubled[(b[i / 2] >> (4 * (i & 1))) & 15];
      w[i] = (v * ws) * m.scale2;
    }
    return;
  }
  int16_t q[kMaxUnit];
  float s[16], mn[16];
  decode_int(fmt, m, r, u, q, s, mn);
  for (int i = 0; i < n; ++i) w[i] = s[i / 16] * q[i] - mn[i / 16];
}

template <int FMT>
void gemv_f32(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
              const int32_t* vidx, int n, float* out, int64_t ldo) {
  constexpr int U = unit_of(FMT);
  float w[U];
  double acc[16];
  for (int64_t r = r0; r < r1; ++r) {
    for (int v0 = 0; v0 < n; v0 += 16) {
      int nv = (int)min64(16, n - v0);
      for (int v = 0; v < nv; ++v) acc[v] = 0;
      for (int64_t u = 0; u * U < cols; ++u) {
        int cnt = (int)min64(U, cols - u * U);
        decode_f32(FMT, m, r, u, cnt, w);
        for (int v = 0; v < nv; ++v) {
          int64_t row = vidx ? vidx[v0 + v] : v0 + v;
          const float* x = a.f + row * a.K + u * U;
          double s = 0;
          for (int i = 0; i < cnt; ++i) s += (double)w[i] * x[i];
          acc[v] += s;
        }
      }
      for (int v = 0; v < nv; ++v) out[(int64_t)(v0 + v) * ldo + (r - r0)] = (float)acc[v];
    }
  }
}

template <int FMT>
void gemv_q8(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
             const int32_t* vidx, int n, float* out, int64_t ldo) {
  constexpr int U = unit_of(FMT);
  int16_t q[U];
  float s[U / 16 + 1], mn[U / 16 + 1];
  double acc[16];
  for (int64_t r = r0; r < r1; ++r) {
    for (int v0 = 0; v0 < n; v0 += 16) {
      int nv = (int)min64(16, n - v0);
      for (int v = 0; v < nv; ++v) acc[v] = 0;
      for (int64_t u = 0; u * U < cols; ++u) {
        decode_int(FMT, m, r, u, q, s, mn);
        for (int v = 0; v < nv; ++v) {
          int64_t row = vidx ? vidx[v0 + v] : v0 + v;
          const int8_t* xq = a.q + row * a.K + u * U;
          const float* xd = a.d + row * (a.K / 32) + u * U / 32;
          for (int g = 0; g < U / 16; ++g) {
            int32_t dot = 0, sum = 0;
            for (int i = 0; i < 16; ++i) {
              dot += q[16 * g + i] * xq[16 * g + i];
              sum += xq[16 * g + i];
            }
            acc[v] += (double)xd[g / 2] * ((double)s[g] * dot - (double)mn[g] * sum);
          }
        }
      }
      // nvfp4's global scale (decode_int leaves it out, as the panels do)
      const double g = FMT == F_NVFP4 ? (double)m.scale2 : 1.0;
      for (int v = 0; v < nv; ++v) out[(int64_t)(v0 + v) * ldo + (r - r0)] = (float)(acc[v] * g);
    }
  }
}

// bf16 weights with bf16 activations: the twin of the AVX512-BF16 dot products.
void gemv_bf16_bf16(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
                    const int32_t* vidx, int n, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.data + r * m.row_bytes;
    for (int v = 0; v < n; ++v) {
      const uint16_t* x = a.bf + (vidx ? vidx[v] : v) * a.K;
      double acc = 0;
      for (int64_t i = 0; i < cols; ++i)
        acc += (double)bf16_to_f32(load_u16(row + 2 * i)) * bf16_to_f32(x[i]);
      out[(int64_t)v * ldo + (r - r0)] = (float)acc;
    }
  }
}

// The batched kernels' reference (BatchFn in common.h), one output at a time.
void batch_ref(const Panel& p, const Act& a, int M, float* out, int64_t ldo) {
  const int64_t K = a.K;
  const int sub = p.sub;
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = a.q + m * K;
    for (int n = 0; n < p.rows; ++n) {
      float acc = 0;
      for (int64_t s = 0; s < p.nsub; ++s) {
        int32_t dot = 0, sum = 0;
        for (int k = 0; k < sub; ++k) {
          int x = xq[s * sub + k];
          dot += x * p.q[((s * sub / 4 + k / 4) * kPanelRows + n) * 4 + k % 4];
          sum += x;
        }
        float d = a.d[m * (K / 32) + s * sub / 32];
        acc = std::fma((float)dot, p.scale[s * kPanelRows + n] * d, acc);
        if (p.min) acc = std::fma(p.min[s * kPanelRows + n], -(d * (float)sum), acc);
      }
      out[m * ldo + n] = acc;
    }
  }
}

uint64_t read_scalar(const uint8_t* p, int64_t bytes) {
  uint64_t acc = 0;
  for (int64_t i = 0; i < bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    acc ^= v;
  }
  return acc;
}

}  // namespace

void register_scalar(KernelTable& t) {
  t.read[ISA_SCALAR] = read_scalar;
  t.quant[ISA_SCALAR] = quantize_q8;
  t.fn[F_BF16][ACT_F32][ISA_SCALAR] = gemv_f32<F_BF16>;
  t.fn[F_Q8_0][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q8_0>;
  t.fn[F_Q4_0][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q4_0>;
  t.fn[F_Q5_0][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q5_0>;
  t.fn[F_Q4_K][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q4_K>;
  t.fn[F_Q5_K][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q5_K>;
  t.fn[F_Q6_K][ACT_F32][ISA_SCALAR] = gemv_f32<F_Q6_K>;
  t.fn[F_MXFP4][ACT_F32][ISA_SCALAR] = gemv_f32<F_MXFP4>;
  t.fn[F_NVFP4][ACT_F32][ISA_SCALAR] = gemv_f32<F_NVFP4>;
  t.fn[F_FP8_BLOCK][ACT_F32][ISA_SCALAR] = gemv_f32<F_FP8_BLOCK>;
  t.fn[F_F32][ACT_F32][ISA_SCALAR] = gemv_f32<F_F32>;
  t.fn[F_BF16][ACT_BF16][ISA_SCALAR] = gemv_bf16_bf16;
  t.fn[F_Q8_0][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q8_0>;
  t.fn[F_Q4_0][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q4_0>;
  t.fn[F_Q5_0][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q5_0>;
  t.fn[F_Q4_K][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q4_K>;
  t.fn[F_Q5_K][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q5_K>;
  t.fn[F_Q6_K][ACT_Q8][ISA_SCALAR] = gemv_q8<F_Q6_K>;
  t.fn[F_MXFP4][ACT_Q8][ISA_SCALAR] = gemv_q8<F_MXFP4>;
  t.fn[F_NVFP4][ACT_Q8][ISA_SCALAR] = gemv_q8<F_NVFP4>;
  for (int f : {F_Q8_0, F_Q4_0, F_Q5_0, F_Q4_K, F_Q5_K, F_Q6_K, F_MXFP4})
    t.batch[f][ISA_SCALAR] = batch_ref;
}

}  // namespace ft
