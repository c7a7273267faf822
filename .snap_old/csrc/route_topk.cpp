// An MoE router's choice on the calling thread: for each token, the A experts of largest
// logit and their weights softmax(logits)[chosen], renormalised over the chosen when the model
// says so. At decode this is one call instead of torch's softmax, top-k, sum, divide and cast.
// The slow twin is MoEBlock.route's torch path in freetoken/models/blocks.py.
#include <cmath>
#include <cstdint>

#include "decode_steps.h"

namespace ft {
namespace {

// a ranks above b: NaN above everything, as torch.topk ranks it.
inline bool above(float a, float b) { return a > b || (a != a && b == b); }

}  // namespace

// logits (T, E); ids (T, A) int64, weights (T, A) float32, largest logit first (ties: the
// lower expert id). Softmax is monotonic, so choosing by logit is choosing by probability.
// A <= E.
void route_topk(const float* logits, int64_t T, int E, int A, bool renormalise, int64_t* ids,
                float* weights) {
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    int64_t* id = ids + t * A;
    float* w = weights + t * A;
    int n = 0;  // chosen so far, kept sorted: insertion into a list of A (A is small)
    for (int e = 0; e < E; ++e) {
      if (n == A && !above(l[e], l[id[A - 1]])) continue;
      int at = n < A ? n++ : A - 1;
      while (at > 0 && above(l[e], l[id[at - 1]])) {
        id[at] = id[at - 1];
        --at;
      }
      id[at] = e;
    }
    const float m = l[id[0]];
    float z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(l[e] - m);
    float chosen = 0;
    for (int a = 0; a < A; ++a) chosen += (w[a] = std::exp(l[id[a]] - m) / z);
    if (renormalise)
      for (int a = 0; a < A; ++a) w[a] /= chosen;
  }
}

}  // namespace ft
