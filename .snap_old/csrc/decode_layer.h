// A decoder layer of CPU float32 decode as one call (decode_layer.cpp): what it reads. One
// descriptor serves the pre-norm MoE layers of Qwen3-MoE and the sandwich-norm dense layers of
// Gemma-3 (norms of the attention and MLP outputs, scales 1 + w, sliding windows).
#pragma once

#include <cstdint>

#include "expert_op.h"

namespace ft {

// What one layer reads; the pointers stay valid while the model lives.
struct DecodeLayer {
  const float* input_norm;  // (H)
  const float* post_norm;   // (H)
  const float* q_norm;      // (D)
  const float* k_norm;      // (D)
  float eps;
  int32_t qkv;     // linear id of q, k and v stacked: (Hq + 2 Hkv) D x H
  int32_t o;       // linear id: H x Hq D
  int32_t router;  // linear id: E x H, f32
  int32_t moe;     // expert layer id
  int32_t H, Hq, Hkv, D, E, A, renormalise;
  float scale;
  float* k_cache;  // (N, Hkv, D)
  float* v_cache;
  const float* cos;  // (P, D)
  const float* sin;
  int64_t P;
  int32_t unit_offset;         // norms scale by 1 + w
  int32_t windowed;            // attention sees the step's visible_window
  const float* attn_out_norm;  // (H) norm of the attention's output before the residual, or null
  const float* ffn_out_norm;   // (H) norm of the MLP's output before the residual, or null
  int32_t q, k, v;             // linear ids where q, k and v do not stack (qkv = -1)
  int32_t gate_up, down;       // a dense MLP (moe = -1): gate and up stacked (2I x H), down
  int32_t I, act;              // its width and activation (expert_op.h Activation)
};

// What every layer of one decode step shares: one new token per sequence.
struct DecodeStep {
  const int64_t* positions;  // (B)
  const int64_t* new_slots;  // (B) cache rows of the new keys
  const int64_t* slots;      // (B, S)
  const uint8_t* visible;    // (B, S)
  int32_t B, S;
  const uint8_t* visible_window;  // (B, S) for windowed layers, or null
};

// x (B, H) is updated in place. 0, or -1 when a job or a position is refused.
int decode_layer(Executor& ex, const DecodeLayer& d, const DecodeStep& st, float* x);

}  // namespace ft
