// The engine thread's single-thread steps of CPU float32 decode: each replaces several torch
// calls whose dispatch costs more than their arithmetic. Called from the C ABI (capi.cpp) and
// from the native decoder layer (decode_layer.cpp).
#pragma once

#include <cstdint>

#include "common.h"

namespace ft {

// q (B, Hq, D); k, v (B, Hkv, D) stored first at cache rows new_slots (B); kc, vc (N, Hkv, D);
// slots (B, S) cache rows of each sequence's keys; visible (B, S); out (B, Hq, D).
// attention_decode.cpp.
void attention_decode(const float* q, const float* k, const float* v, const int64_t* new_slots,
                      float* kc, float* vc, const int64_t* slots, const uint8_t* visible, int B,
                      int S, int Hq, int Hkv, int D, float scale, float* out);
// x, y (rows, dim); scale w or 1 + w. rms_norm.cpp.
void rms_norm(const float* x, const float* w, int64_t rows, int dim, float eps, bool unit_offset,
              float* y);
// x, y (T, heads, D); cos, sin (P, D); -1 when a position is outside the tables. rotary.cpp.
int rotary_neox(const float* x, const float* cos, const float* sin, int64_t P,
                const int64_t* positions, int64_t T, int heads, int D, float* y);
// out (T, I) = activate(act, g) * u for g, u (T, I) rows `g_stride` / `u_stride` floats apart
// (the two halves of a stacked gate/up output). glu.cpp.
void glu(const float* g, int64_t g_stride, const float* u, int64_t u_stride, int64_t T, int I,
         int act, float* out);
// logits (T, E) -> the top A ids and weights per token, A <= E. route_topk.cpp.
void route_topk(const float* logits, int64_t T, int E, int A, bool renormalise, int64_t* ids,
                float* weights);

// sum a[i] * b[i] over 16 independent partial sums (the compiler keeps them in vectors of the
// caller's width), reduced pairwise: each level is one vector add, where a chain of 16 scalar
// adds would cost more than the products.
static inline __attribute__((always_inline)) float dot_f32(const float* a, const float* b,
                                                           int n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return s + acc[0];
}

}  // namespace ft
