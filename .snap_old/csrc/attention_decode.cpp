// Decode attention on the CPU: one new query token per sequence against that sequence's keys
// in one layer's paged KV cache, grouped-query, float32, on the calling thread. It replaces the
// dozen torch calls of a decode step's attention (gathers, transposes, SDPA), whose dispatch
// costs more than their arithmetic at batch 1. The slow twin is torch's
// scaled_dot_product_attention path in freetoken/layers/attention.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_steps.h"
#include "exp_nonpositive.h"

namespace ft {
namespace {


// 16 floats as one value of the widest vectors the clone has (two or four of them below
// AVX-512); the shuffles below lower to permutes.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The lane sums of a[0..7] in lanes 0..7: each level adds the halves of two vectors at once,
// so eight sums cost four levels instead of eight separate reductions.
inline __attribute__((always_inline)) v16 sum8(const v16* a) {
  const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i16 even = {0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14};
  const i16 odd = {1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15};
  v16 b[4], c[2];
  for (int i = 0; i < 4; ++i)  // b[i]: a[2i] in lanes 0..7, a[2i+1] in 8..15
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo8) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi8);
  for (int i = 0; i < 2; ++i)  // c[i]: four lanes each of a[4i..4i+3]
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], hi4);
  const v16 d = __builtin_shuffle(c[0], c[1], lo2) + __builtin_shuffle(c[0], c[1], hi2);
  return __builtin_shuffle(d, even) + __builtin_shuffle(d, odd);
}

// GB (<= 8) query heads against one key row, D % 16 == 0: res[g] = dot(q + g * D, k).
template <int GB>
inline __attribute__((always_inline)) void dots(const float* q, const float* k, int D,
                                                float* res) {
  v16 a[8] = {};
  for (int i = 0; i < D; i += 16) {
    const v16 kv = load16(k + i);
    for (int g = 0; g < GB; ++g) a[g] += load16(q + (int64_t)g * D + i) * kv;
  }
  const v16 s = sum8(a);
  for (int g = 0; g < GB; ++g) res[g] = s[g];
}

inline __attribute__((always_inline)) void dots_upto8(const float* q, const float* k, int D,
                                                      int gb, float* res) {
  switch (gb) {
    case 8: return dots<8>(q, k, D, res);
    case 7: return dots<7>(q, k, D, res);
    case 6: return dots<6>(q, k, D, res);
    case 5: return dots<5>(q, k, D, res);
    case 4: return dots<4>(q, k, D, res);
    case 3: return dots<3>(q, k, D, res);
    case 2: return dots<2>(q, k, D, res);
    default: return dots<1>(q, k, D, res);
  }
}

// out[g] (D floats each, D % 16 == 0) = sum over visible j of p[g * S + j] * value row j, for
// GB (<= 8) query heads: each value row is read once per 16 columns for all of them.
template <int GB>
inline __attribute__((always_inline)) void weighted_values(const float* p, int S,
                                                           const float* const* vrows, int D,
                                                           float* out) {
  for (int c = 0; c < D; c += 16) {
    v16 a[8] = {};
    for (int j = 0; j < S; ++j) {
      if (!vrows[j]) continue;
      const v16 vv = load16(vrows[j] + c);
      for (int g = 0; g < GB; ++g) a[g] += p[(size_t)g * S + j] * vv;
    }
    for (int g = 0; g < GB; ++g) std::memcpy(out + (int64_t)g * D + c, &a[g], sizeof(v16));
  }
}

inline __attribute__((always_inline)) void weighted_values_upto8(const float* p, int S,
                                                                 const float* const* vrows,
                                                                 int D, int gb, float* out) {
  switch (gb) {
    case 8: return weighted_values<8>(p, S, vrows, D, out);
    case 7: return weighted_values<7>(p, S, vrows, D, out);
    case 6: return weighted_values<6>(p, S, vrows, D, out);
    case 5: return weighted_values<5>(p, S, vrows, D, out);
    case 4: return weighted_values<4>(p, S, vrows, D, out);
    case 3: return weighted_values<3>(p, S, vrows, D, out);
    case 2: return weighted_values<2>(p, S, vrows, D, out);
    default: return weighted_values<1>(p, S, vrows, D, out);
  }
}

inline __attribute__((always_inline)) void axpy(float w, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// q (B, Hq, D); k, v (B, Hkv, D) the new token's, stored first at cache rows new_slots (B);
// kc, vc (N, Hkv, D) the layer's cache; slots (B, S) cache rows of each sequence's keys;
// visible (B, S) which of them each query sees; out (B, Hq, D). Hq % Hkv == 0. Compiled per
// vector width, picked at load time by the CPU.
FT_VECTOR_WIDTHS
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
  thread_local std::vector<const float*> vrows;
  p.resize((size_t)G * S);
  sum.resize(G);
  vrows.resize(S);
  for (int b = 0; b < B; ++b) {
    const int64_t* sl = slots + (int64_t)b * S;
    const uint8_t* vis = visible + (int64_t)b * S;
    for (int kvh = 0; kvh < Hkv; ++kvh) {
      const float* qg = q + ((int64_t)b * Hq + (int64_t)kvh * G) * D;  // G query heads
      float* og = out + ((int64_t)b * Hq + (int64_t)kvh * G) * D;
      for (int j = 0; j < S; ++j) {
        if (!vis[j]) continue;
        const float* kr = kc + (sl[j] * Hkv + kvh) * D;
        if (D % 16 == 0) {
          float res[8];
          for (int g0 = 0; g0 < G; g0 += 8) {
            const int gb = G - g0 < 8 ? G - g0 : 8;
            dots_upto8(qg + (int64_t)g0 * D, kr, D, gb, res);
            for (int g = 0; g < gb; ++g) p[(size_t)(g0 + g) * S + j] = scale * res[g];
          }
        } else {
          for (int g = 0; g < G; ++g)
            p[(size_t)g * S + j] = scale * dot_f32(qg + (int64_t)g * D, kr, D);
        }
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
      for (int g = 0; g < G; ++g) {
        const float inv = sum[g] > 0 ? 1.0f / sum[g] : 0.0f;
        float* pg = p.data() + (size_t)g * S;
        for (int j = 0; j < S; ++j) pg[j] *= inv;
      }
      if (D % 16 == 0) {
        for (int j = 0; j < S; ++j) vrows[j] = vis[j] ? vc + (sl[j] * Hkv + kvh) * D : nullptr;
        for (int g0 = 0; g0 < G; g0 += 8)
          weighted_values_upto8(p.data() + (size_t)g0 * S, S, vrows.data(), D,
                                G - g0 < 8 ? G - g0 : 8, og + (int64_t)g0 * D);
        continue;
      }
      std::memset(og, 0, (size_t)G * D * sizeof(float));
      for (int j = 0; j < S; ++j) {
        if (!vis[j]) continue;
        const float* vr = vc + (sl[j] * Hkv + kvh) * D;
        for (int g = 0; g < G; ++g) axpy(p[(size_t)g * S + j], vr, og + (int64_t)g * D, D);
      }
    }
  }
}

}  // namespace ft
