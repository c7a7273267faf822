// A dense MLP's gated activation on the engine thread: one pass over the gate and up outputs.
// SiLU and tanh-GELU are written through one exp whose every step the compiler can keep in
// vectors (no libm call per element); the file is compiled without contraction, so every
// width it is built for gives the same bits. GELU (erf) keeps the scalar `activate`.
#include <cstring>

#include "decode_steps.h"
#include "exp_nonpositive.h"
#include "expert_op.h"

namespace ft {
namespace {

// g * sigmoid(z) for z of either sign, through e^-|z|.
static inline float times_sigmoid(float g, float z) {
  float e = exp_nonpositive(z < 0 ? z : -z);
  float s = 1.0f / (1.0f + e);
  return g * (z < 0 ? e * s : s);
}

// 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3).
static inline float gelu_tanh(float g) {
  return times_sigmoid(g, 1.5957691216057308f * (g + 0.044715f * g * (g * g)));
}

template <int kAct>
FT_VECTOR_WIDTHS void glu_rows(const float* g, int64_t g_stride, const float* u,
                               int64_t u_stride, int64_t T, int I, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* gt = g + t * g_stride;
    const float* ut = u + t * u_stride;
    float* o = out + t * I;
    for (int i = 0; i < I; ++i)
      o[i] = (kAct == ACTV_SILU ? times_sigmoid(gt[i], gt[i]) : gelu_tanh(gt[i])) * ut[i];
  }
}

}  // namespace

void glu(const float* g, int64_t g_stride, const float* u, int64_t u_stride, int64_t T, int I,
         int act, float* out) {
  if (act == ACTV_SILU) return glu_rows<ACTV_SILU>(g, g_stride, u, u_stride, T, I, out);
  if (act == ACTV_GELU_TANH)
    return glu_rows<ACTV_GELU_TANH>(g, g_stride, u, u_stride, T, I, out);
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < I; ++i)
      out[t * I + i] = activate(act, g[t * g_stride + i]) * u[t * u_stride + i];
}

}  // namespace ft
