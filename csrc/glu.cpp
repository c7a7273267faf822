// A dense MLP's gated activation on the engine thread: one pass over the gate and up outputs.
#include "decode_steps.h"
#include "expert_op.h"

namespace ft {

void glu(const float* g, int64_t g_stride, const float* u, int64_t u_stride, int64_t T, int I,
         int act, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* gt = g + t * g_stride;
    const float* ut = u + t * u_stride;
    float* o = out + t * I;
    for (int i = 0; i < I; ++i) o[i] = activate(act, gt[i]) * ut[i];
  }
}

}  // namespace ft
