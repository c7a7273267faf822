// RMSNorm of float32 rows on the calling thread: y = x / sqrt(mean(x^2) + eps) * scale, where
// scale is w (Qwen, Llama) or 1 + w (Gemma). On the CPU at decode a norm is a few thousand
// floats, and torch's five calls (pow, mean, add, rsqrt, two muls) cost more in dispatch than in
// arithmetic. The slow twin is RMSNorm's torch path in freetoken/layers/norm.py.
#include <cmath>
#include <cstdint>

#include "decode_steps.h"

namespace ft {

// x, y (rows, dim), may be the same buffer; w (dim). Compiled per vector width, picked at load
// time by the CPU.
FT_VECTOR_WIDTHS
void rms_norm(const float* x, const float* w, int64_t rows, int dim, float eps, bool unit_offset,
              float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.0f / std::sqrt(dot_f32(xr, xr, dim) / (float)dim + eps);
    // the torch path's order: the normalised value first, then the scale
    if (unit_offset)
      for (int j = 0; j < dim; ++j) yr[j] = (xr[j] * inv) * (1.0f + w[j]);
    else
      for (int j = 0; j < dim; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

}  // namespace ft
