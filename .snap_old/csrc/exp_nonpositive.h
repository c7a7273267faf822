// e^x for x <= 0 in a form loops vectorise: the attention softmax's scores less their max, the
// activations' sigmoids. Each file that includes it compiles it with its own flags.
#pragma once

#include <cstdint>
#include <cstring>

namespace ft {

// Within about an ulp of expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to
// r^7, 2^n through the exponent bits. Branch-free, so a loop of them vectorises (libm's expf
// is a call per element).
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

}  // namespace ft
