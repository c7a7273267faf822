// One decoder layer of CPU float32 decode, driven from C++ on the engine thread:
//   h = x + N_a(o(attention(rotary(k_norm/q_norm(qkv(input_norm(x)))))))
//   x' = h + N_f(mlp(post_norm(h)))
// mlp: the experts of the router's top-k (Qwen3-MoE), or down(act(gate) * up) (Gemma-3); N_a
// and N_f: the output norms of sandwich-norm layers (Gemma-3), else identity. The matrices are
// pool jobs and the rest the library's single-thread steps. At batch 1 the same steps driven
// from Python cost more in call overhead than they compute. The slow twin is the model's own
// modules (freetoken/models/qwen3_moe.py, gemma3.py), which run the same functions and
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

// q, k and v from one stacked matrix, or from three (submitted together, then waited).
int run_qkv(Executor& ex, const DecodeLayer& d, const float* h, float* qkv, float* q, float* k,
            float* v, int B) {
  const int64_t qw = (int64_t)d.Hq * d.D, kw = (int64_t)d.Hkv * d.D, W = qw + 2 * kw;
  if (d.qkv < 0) {
    int64_t jq = ex.submit_linear(d.q, h, q, B);
    int64_t jk = jq < 0 ? -1 : ex.submit_linear(d.k, h, k, B);
    int64_t jv = jk < 0 ? -1 : ex.submit_linear(d.v, h, v, B);
    for (int64_t j : {jq, jk, jv})
      if (j >= 0) ex.wait(j);
    return jv < 0 ? -1 : 0;
  }
  if (run_linear(ex, d.qkv, h, qkv, B)) return -1;
  for (int b = 0; b < B; ++b) {  // the stacked output's q, k and v parts
    const float* r = qkv + (int64_t)b * W;
    std::memcpy(q + b * qw, r, qw * sizeof(float));
    std::memcpy(k + b * kw, r + qw, kw * sizeof(float));
    std::memcpy(v + b * kw, r + qw + kw, kw * sizeof(float));
  }
  return 0;
}

}  // namespace

// x (B, H) is updated in place. 0, or -1 when a job or a position is refused (the caller
// then reports it, or runs its slow twin for the message).
int decode_layer(Executor& ex, const DecodeLayer& d, const DecodeStep& st, float* x) {
  const int B = st.B, H = d.H, D = d.D, Hq = d.Hq, Hkv = d.Hkv;
  const int64_t qw = (int64_t)Hq * D, kw = (int64_t)Hkv * D, W = qw + 2 * kw;
  thread_local std::vector<float> h, qkv, q, k, v, att, o, logits, w, moe, gu, a;
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
  const bool uo = d.unit_offset != 0;

  rms_norm(x, d.input_norm, B, H, d.eps, uo, h.data());
  if (run_qkv(ex, d, h.data(), qkv.data(), q.data(), k.data(), v.data(), B)) return -1;
  rms_norm(q.data(), d.q_norm, (int64_t)B * Hq, D, d.eps, uo, q.data());
  rms_norm(k.data(), d.k_norm, (int64_t)B * Hkv, D, d.eps, uo, k.data());
  if (rotary_neox(q.data(), d.cos, d.sin, d.P, st.positions, B, Hq, D, q.data()) ||
      rotary_neox(k.data(), d.cos, d.sin, d.P, st.positions, B, Hkv, D, k.data()))
    return -1;
  const uint8_t* visible = d.windowed ? st.visible_window : st.visible;
  if (!visible) return -1;
  attention_decode(q.data(), k.data(), v.data(), st.new_slots, d.k_cache, d.v_cache, st.slots,
                   visible, B, st.S, Hq, Hkv, D, d.scale, att.data());
  if (run_linear(ex, d.o, att.data(), o.data(), B)) return -1;
  if (d.attn_out_norm) rms_norm(o.data(), d.attn_out_norm, B, H, d.eps, uo, o.data());
  for (int64_t i = 0; i < (int64_t)B * H; ++i) x[i] = x[i] + o[i];

  rms_norm(x, d.post_norm, B, H, d.eps, uo, h.data());
  if (d.moe >= 0) {
    if (run_linear(ex, d.router, h.data(), logits.data(), B)) return -1;
    route_topk(logits.data(), B, d.E, d.A, d.renormalise != 0, ids.data(), w.data());
    int64_t job = ex.submit(d.moe, h.data(), ids.data(), w.data(), moe.data(), B, d.A);
    if (job < 0) return -1;
    ex.wait(job);
  } else {
    const int64_t I = d.I;
    gu.resize((size_t)B * 2 * I);
    a.resize((size_t)B * I);
    if (run_linear(ex, d.gate_up, h.data(), gu.data(), B)) return -1;
    glu(gu.data(), 2 * I, gu.data() + I, 2 * I, B, (int)I, d.act, a.data());
    if (run_linear(ex, d.down, a.data(), moe.data(), B)) return -1;
  }
  if (d.ffn_out_norm) rms_norm(moe.data(), d.ffn_out_norm, B, H, d.eps, uo, moe.data());
  for (int64_t i = 0; i < (int64_t)B * H; ++i) x[i] = x[i] + moe[i];
  return 0;
}

}  // namespace ft
