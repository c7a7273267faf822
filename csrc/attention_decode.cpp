// Decode attention on the CPU: one new query token per sequence against that sequence's keys
// in one layer's paged KV cache, grouped-query, float32, on the calling thread. It replaces the
// dozen torch calls of a decode step's attention (gathers, transposes, SDPA), whose dispatch
// costs more than their arithmetic at batch 1. The slow twin is torch's
// scaled_dot_product_attention path in freetoken/layers/attention.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace ft {
namespace {

constexpr int kLanes = 16;  // independent partial sums: the compiler keeps them in vectors

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  // pairwise, so each level is one vector add: a chain of 16 scalar adds cost more than the
  // products
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return s + acc[0];
}

// e^x for x <= 0 (scores less their max), within about an ulp of expf: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to r^7, 2^n through the exponent bits. Branch-free,
// so a loop of them vectorises (libm's expf is a call per score).
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float e = 1.0f / 5040;
  e = e * r + 1.0f / 720;
  e = e * r + 1.0f / 120;
  e = e * r + 1.0f / 24;
  e = e * r + 1.0f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e * two_n;
}

inline __attribute__((always_inline)) void axpy(float w, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// q (B, Hq, D); k, v (B, Hkv, D) the new token's, stored first at cache rows new_slots (B);
// kc, vc (N, Hkv, D) the layer's cache; slots (B, S) cache rows of each sequence's keys;
// visible (B, S) which of them each query sees; out (B, Hq, D). Hq % Hkv == 0. Compiled per
// vector width, picked at load time by the CPU.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attention_decode(const float* q, const float* k, const float* v, const int64_t* new_slots,
                      float* kc, float* vc, const int64_t* slots, const uint8_t* visible, int B,
                      int S, int Hq, int Hkv, int D, float scale, float* out) {
  const size_t row = (size_t)Hkv * D * sizeof(float);
  for (int b = 0; b < B; ++b) {
    std::memcpy(kc + new_slots[b] * Hkv * D, k + (int64_t)b * Hkv * D, row);
    std::memcpy(vc + new_slots[b] * Hkv * D, v + (int64_t)b * Hkv * D, row);
  }
  const int G = Hq / Hkv;  // query heads per kv head: each key and value row is read once
  // Scores and sums, kept per thread: this runs once per layer per decode step.
  thread_local std::vector<float> p, sum;
  p.resize((size_t)G * S);
  sum.resize(G);
  for (int b = 0; b < B; ++b) {
    const int64_t* sl = slots + (int64_t)b * S;
    const uint8_t* vis = visible + (int64_t)b * S;
    for (int kvh = 0; kvh < Hkv; ++kvh) {
      const float* qg = q + ((int64_t)b * Hq + (int64_t)kvh * G) * D;  // G query heads
      float* og = out + ((int64_t)b * Hq + (int64_t)kvh * G) * D;
      for (int j = 0; j < S; ++j) {
        if (!vis[j]) continue;
        const float* kr = kc + (sl[j] * Hkv + kvh) * D;
        for (int g = 0; g < G; ++g) p[(size_t)g * S + j] = scale * dot(qg + (int64_t)g * D, kr, D);
      }
      for (int g = 0; g < G; ++g) {
        float* pg = p.data() + (size_t)g * S;
        float m = -INFINITY;
        for (int j = 0; j < S; ++j)
          if (vis[j]) m = pg[j] > m ? pg[j] : m;
        for (int j = 0; j < S; ++j) pg[j] = vis[j] ? exp_nonpositive(pg[j] - m) : 0.0f;
        float s = 0;
        for (int j = 0; j < S; ++j) s += pg[j];
        sum[g] = m == -INFINITY ? 0.0f : s;
      }
      std::memset(og, 0, (size_t)G * D * sizeof(float));
      for (int j = 0; j < S; ++j) {
        if (!vis[j]) continue;
        const float* vr = vc + (sl[j] * Hkv + kvh) * D;
        for (int g = 0; g < G; ++g)
          if (sum[g] > 0) axpy(p[(size_t)g * S + j] / sum[g], vr, og + (int64_t)g * D, D);
      }
    }
  }
}

}  // namespace ft
