// Activation vectors in the representations the row kernels read: bf16 bits, and int8 blocks
// of 32 with their scales and per-4 sums (Q8), the format VNNI kernels multiply against.
#include "expert_op.h"

namespace ft {

void quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* dl, int32_t* gs,
                 int32_t* gb) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0;
    for (int i = 0; i < 32; ++i) {
      float a = xb[i] < 0 ? -xb[i] : xb[i];
      amax = a > amax ? a : amax;
    }
    float db = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = db;
    for (int g = 0; g < 8; ++g) {
      int32_t s = 0;
      for (int i = 0; i < 4; ++i) {
        // round to nearest even without a libm call: |x * id| <= 127 < 2^22
        float v = (xb[4 * g + i] * id + 12582912.0f) - 12582912.0f;
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        int8_t qi = (int8_t)v;
        q[32 * b + 4 * g + i] = qi;
        s += qi;
      }
      gs[8 * b + g] = s;
      gb[8 * b + g] = -128 * s;
      dl[8 * b + g] = db;
    }
  }
}

void act_sizes(int64_t n, int64_t K, bool bf16, bool q8, size_t* sizes) {
  sizes[0] = bf16 ? (size_t)(n * K * 2) : 0;
  sizes[1] = q8 ? (size_t)(n * K) : 0;
  sizes[2] = q8 ? (size_t)(n * (K / 32) * 4) : 0;
  for (int i = 3; i < kActParts; ++i) sizes[i] = q8 ? (size_t)(n * (K / 4) * 4) : 0;
}

Act act_view(int64_t K, const float* f, uint8_t* const* p) {
  return Act{K, f, (uint16_t*)p[0], (int8_t*)p[1], (float*)p[2], (float*)p[3], (int32_t*)p[4],
             (int32_t*)p[5]};
}

void encode_act(const float* x, int act, const Act& a, int64_t t, QuantFn quant) {
  const int64_t K = a.K;
  if (act == ACT_BF16) {
    uint16_t* o = const_cast<uint16_t*>(a.bf) + t * K;
    for (int64_t i = 0; i < K; ++i) o[i] = f32_to_bf16(x[i]);
  } else if (act == ACT_Q8) {
    quant(x, K, const_cast<int8_t*>(a.q) + t * K, const_cast<float*>(a.d) + t * (K / 32),
                const_cast<float*>(a.dl) + t * (K / 4), const_cast<int32_t*>(a.gs) + t * (K / 4),
                const_cast<int32_t*>(a.gb) + t * (K / 4));
  }
}

}  // namespace ft
