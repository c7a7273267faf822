// Rotary position embedding, NeoX layout, of float32 heads on the calling thread: each head's
// halves (a, b) become (a cos - b sin, b cos + a sin) with the angles of the token's position.
// One call replaces the torch path's two gathers, a concatenation and three arithmetic calls.
// The slow twin is Rotary's torch path in freetoken/layers/rotary.py; the products and the sum
// are rounded as that path rounds them (built without fused multiply-adds), so the bits agree.
#include <cstdint>

#include "decode_steps.h"

namespace ft {

// x, y (T, heads, D), may be the same buffer; cos, sin (P, D) tables; positions (T). Returns
// -1, writing nothing, when a position is outside the tables.
FT_VECTOR_WIDTHS
int rotary_neox(const float* x, const float* cos, const float* sin, int64_t P,
                const int64_t* positions, int64_t T, int heads, int D, float* y) {
  for (int64_t t = 0; t < T; ++t)
    if (positions[t] < 0 || positions[t] >= P) return -1;
  const int half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * D;
    const float* s = sin + positions[t] * D;
    for (int h = 0; h < heads; ++h) {
      const float* xh = x + (t * heads + h) * D;
      float* yh = y + (t * heads + h) * D;
      for (int i = 0; i < half; ++i) {
        const float a = xh[i], b = xh[i + half];
        const float lo = a * c[i] + (-b) * s[i];
        const float hi = b * c[i + half] + a * s[i + half];
        yh[i] = lo;
        yh[i + half] = hi;
      }
    }
  }
  return 0;
}

}  // namespace ft
