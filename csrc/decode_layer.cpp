// One pre-norm decoder layer of CPU float32 decode, driven from C++ on the engine thread:
//   h = x + o(attention(rotary(k_norm/q_norm(qkv(input_norm(x))))))
//   x' = h + experts(router top-k(post_norm(h)))
// with the matrices as pool jobs and the rest as the library's single-thread steps. At batch 1
// the same steps driven from Python cost more in call overhead than they compute. The slow twin
// is the model's own modules (freetoken/models/qwen3_moe.py), which run the same functions and
// kernels in the same order, so the two agree bit for bit.
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_layer.h"
#include "decode_steps.h"

namespace ft {

namespace {

int run_linear(Executor& ex, int id, const float* x, float* out, int T) {
  int64_t h = ex.submit_linear(id, x, out, T);
  if (h < 0) return -1;
  ex.wait(h);
  return 0;
}

}  // namespace

// x (B, H) is updated in place. 0, or -1 when a job or a position is refused (the caller
// then reports it, or runs its slow twin for the message).
int decode_layer(Executor& ex, const DecodeLayer& d, const DecodeStep& st, float* x) {
  const int B = st.B, H = d.H, D = d.D, Hq = d.Hq, Hkv = d.Hkv;
  const int64_t qw = (int64_t)Hq * D, kw = (int64_t)Hkv * D, W = qw + 2 * kw;
  thread_local std::vector<float> h, qkv, q, k, v, att, o, logits, w, moe;
  thread_local std::vector<int64_t> ids;
  h.resize((size_t)B * H);
  qkv.resize((size_t)B * W);
  q.resize((size_t)B * qw);
  k.resize((size_t)B * kw);
  v.resize((size_t)B * kw);
  att.resize((size_t)B * qw);
  o.resize((size_t)B * H);
  logits.resize((size_t)B * d.E);
  ids.resize((size_t)B * d.A);
  w.resize((size_t)B * d.A);
  moe.resize((size_t)B * H);

  rms_norm(x, d.input_norm, B, H, d.eps, false, h.data());
  if (run_linear(ex, d.qkv, h.data(), qkv.data(), B)) return -1;
  for (int b = 0; b < B; ++b) {  // the stacked output's q, k and v parts
    const float* r = qkv.data() + (int64_t)b * W;
    std::memcpy(q.data() + b * qw, r, qw * sizeof(float));
    std::memcpy(k.data() + b * kw, r + qw, kw * sizeof(float));
    std::memcpy(v.data() + b * kw, r + qw + kw, kw * sizeof(float));
  }
  rms_norm(q.data(), d.q_norm, (int64_t)B * Hq, D, d.eps, false, q.data());
  rms_norm(k.data(), d.k_norm, (int64_t)B * Hkv, D, d.eps, false, k.data());
  if (rotary_neox(q.data(), d.cos, d.sin, d.P, st.positions, B, Hq, D, q.data()) ||
      rotary_neox(k.data(), d.cos, d.sin, d.P, st.positions, B, Hkv, D, k.data()))
    return -1;
  attention_decode(q.data(), k.data(), v.data(), st.new_slots, d.k_cache, d.v_cache, st.slots,
                   st.visible, B, st.S, Hq, Hkv, D, d.scale, att.data());
  if (run_linear(ex, d.o, att.data(), o.data(), B)) return -1;
  for (int64_t i = 0; i < (int64_t)B * H; ++i) x[i] = x[i] + o[i];

  rms_norm(x, d.post_norm, B, H, d.eps, false, h.data());
  if (run_linear(ex, d.router, h.data(), logits.data(), B)) return -1;
  route_topk(logits.data(), B, d.E, d.A, d.renormalise != 0, ids.data(), w.data());
  int64_t job = ex.submit(d.moe, h.data(), ids.data(), w.data(), moe.data(), B, d.A);
  if (job < 0) return -1;
  ex.wait(job);
  for (int64_t i = 0; i < (int64_t)B * H; ++i) x[i] = x[i] + moe[i];
  return 0;
}

}  // namespace ft
