// The C ABI that freetoken/cpu/library.py loads with ctypes (a decode step's host side: in
// capi_step.cpp).
// Pointers are raw host addresses of contiguous tensors the caller keeps alive. The first
// group of functions describes the ABI itself; freetoken/cpu/abi.py checks it at load.
#include <cstring>
#include <string>
#include <vector>

#include "capi.h"
#include "decode_layer.h"
#include "decode_steps.h"
#include "dispatch.h"
#include "expert_op.h"
#include "graph_flags.h"
#include "host_node.h"
#include "layer_call.h"
#include "panels.h"
#include "row_copy.h"

namespace {

// One projection of all experts, as the caller describes it.
struct ProjDesc {
  int32_t fmt;
  int64_t rows, cols;
  const uint64_t* data;     // (E) address of each expert's data
  int64_t row_bytes;
  const uint64_t* scale;    // (E) or null
  int64_t scale_row_bytes;
  const float* scale2;      // (E) or null
  int64_t expert_bytes;
};

// A layer's ExpertGlu, as the caller describes it: biases (E, I), (E, I), (E, H) or null.
struct GluDesc {
  float alpha, limit;
  const float* gate_bias;
  const float* up_bias;
  const float* down_bias;
};

ft::ExpertGlu to_glu(const GluDesc* d, int E, int H, int I) {
  ft::ExpertGlu g;
  if (!d) return g;
  g.alpha = d->alpha;
  g.limit = d->limit;
  const size_t EI = (size_t)E * I, EH = (size_t)E * H;
  if (d->gate_bias) g.gate_bias.assign(d->gate_bias, d->gate_bias + EI);
  if (d->up_bias) g.up_bias.assign(d->up_bias, d->up_bias + EI);
  if (d->down_bias) g.down_bias.assign(d->down_bias, d->down_bias + EH);
  return g;
}

ft::Proj to_proj(const ProjDesc& d, int E) {
  ft::Proj p;
  p.fmt = d.fmt;
  p.rows = d.rows;
  p.cols = d.cols;
  p.expert_bytes = d.expert_bytes;
  p.experts.resize(E);
  for (int e = 0; e < E; ++e) {
    ft::Mat& m = p.experts[e];
    m.data = (const uint8_t*)(uintptr_t)d.data[e];
    m.row_bytes = d.row_bytes;
    m.scale = d.scale ? (const uint8_t*)(uintptr_t)d.scale[e] : nullptr;
    m.scale_row_bytes = d.scale_row_bytes;
    m.scale2 = d.scale2 ? d.scale2[e] : 1.0f;
  }
  return p;
}

void copy_error(const std::string& s, char* buf, int len) {
  if (!buf || len <= 0) return;
  std::strncpy(buf, s.c_str(), len - 1);
  buf[len - 1] = 0;
}

}  // namespace

// What the Python side checks before it calls anything else: the ABI version, the names
// behind each enum's numbers, each format's block, and the sizes of the structs it mirrors.
FT_API int ft_abi_version() { return ft::ABI_VERSION; }

FT_API int ft_format_count() { return ft::F_COUNT; }

// Format `fmt`'s name (null past the last), and its block: weights and bytes.
FT_API const char* ft_format_info(int fmt, int* block, int* block_bytes) {
  if (fmt < 0 || fmt >= ft::F_COUNT) return nullptr;
  *block = ft::FMT_INFO[fmt].block;
  *block_bytes = ft::FMT_INFO[fmt].block_bytes;
  return ft::FMT_INFO[fmt].name;
}

FT_API int ft_isa_count() { return ft::ISA_COUNT; }

FT_API const char* ft_act_name(int act) {
  static const char* names[ft::ACT_COUNT] = {"f32", "q8", "bf16"};
  return act >= 0 && act < ft::ACT_COUNT ? names[act] : nullptr;
}

FT_API int ft_act_count() { return ft::ACT_COUNT; }

// sizeof a struct the caller fills ("ProjDesc", "DecodeLayer", "DecodeStep"); -1 for another.
FT_API int64_t ft_struct_size(const char* name) {
  std::string n(name ? name : "");
  if (n == "ProjDesc") return sizeof(ProjDesc);
  if (n == "GluDesc") return sizeof(GluDesc);
  if (n == "DecodeLayer") return sizeof(ft::DecodeLayer);
  if (n == "DecodeStep") return sizeof(ft::DecodeStep);
  if (n == "RowCopyApi") return sizeof(ft::RowCopyApi);
  if (n == "RowCopy") return sizeof(ft::RowCopy);
  if (n == "HostNodeStep") return sizeof(ft::HostNodeStep);
  if (n == "HostNodeJob") return sizeof(ft::HostNodeJob);
  if (n == "FlagJobs") return sizeof(ft::FlagJobs);
  if (n == "FetchRule") return sizeof(ft::FetchRule);
  if (n == "LayerCall") return sizeof(ft::LayerCall);
  if (n == "AheadRule") return sizeof(ft::AheadRule);
  if (n == "Ahead") return sizeof(ft::Ahead);
  return -1;
}

FT_API int ft_best_isa() { return ft::best_isa(); }

// Decode attention (csrc/attention_decode.cpp) on the calling thread: stores the new keys and
// values, then attends.
FT_API void ft_attention_decode(const float* q, const float* k, const float* v,
                                const int64_t* new_slots, float* kc, float* vc,
                                const int64_t* slots, const uint8_t* visible, int B, int S,
                                int Hq, int Hkv, int D, float scale, float* out) {
  ft::attention_decode(q, k, v, new_slots, kc, vc, slots, visible, B, S, Hq, Hkv, D, scale, out);
}

// RMSNorm of float32 rows (csrc/rms_norm.cpp) on the calling thread.
FT_API void ft_rms_norm(const float* x, const float* w, int64_t rows, int dim, float eps,
                        int unit_offset, float* y) {
  ft::rms_norm(x, w, rows, dim, eps, unit_offset != 0, y);
}

// NeoX rotary embedding of float32 heads (csrc/rotary.cpp) on the calling thread; -1 when a
// position is outside the P rows of the tables.
FT_API int ft_rotary_neox(const float* x, const float* cos, const float* sin, int64_t P,
                          const int64_t* positions, int64_t T, int heads, int D, float* y) {
  return ft::rotary_neox(x, cos, sin, P, positions, T, heads, D, y);
}

// An MoE router's top-A choice and weights (csrc/route_topk.cpp) on the calling thread.
FT_API void ft_route_topk(const float* logits, int64_t T, int E, int A, int renormalise,
                          int64_t* ids, float* weights) {
  ft::route_topk(logits, T, E, A, renormalise != 0, ids, weights);
}

FT_API const char* ft_isa_name(int isa) { return ft::isa_name(isa); }

// The tier of the kernel that (fmt, act) gets under `cap`, or -1 when there is none.
FT_API int ft_kernel_isa(int fmt, int act, int cap) { return ft::pick_kernel(fmt, act, cap).isa; }

// The tier of fmt's batched kernel under `cap`, or -1 when there is none.
FT_API int ft_batch_isa(int fmt, int cap) { return ft::pick_batch(fmt, cap).isa; }

// out (M, rows) = x (M, cols) @ W^T with fmt's batched kernel and panel decoder at or below
// `cap` on the calling thread (W: rows x cols in fmt, row_bytes apart), x quantised by the
// scalar quantiser (every tier's bits). Returns the tier used, or -1 when fmt has none or cols is not whole sub-blocks.
FT_API int ft_batch_linear(int fmt, int cap, const uint8_t* w, int64_t rows, int64_t cols,
                           int64_t row_bytes, const float* x, int M, float* out) {
  ft::BatchPick b = ft::pick_batch(fmt, cap);
  if (!b.fn || cols % 32 || cols % ft::FMT_INFO[fmt].block) return -1;
  std::vector<int8_t> q((size_t)(M * cols));
  std::vector<float> d((size_t)(M * cols / 32)), dl((size_t)(M * cols / 4));
  std::vector<int32_t> gs((size_t)(M * cols / 4)), gb(gs.size());
  for (int m = 0; m < M; ++m)
    ft::quantize_q8(x + m * cols, cols, q.data() + m * cols, d.data() + m * (cols / 32),
                    dl.data() + m * (cols / 4), gs.data() + m * (cols / 4),
                    gb.data() + m * (cols / 4));
  ft::Act a{cols, x, nullptr, q.data(), d.data(), dl.data(), gs.data(), gb.data()};
  ft::Mat mat{w, row_bytes, nullptr, 0, 1.0f};
  ft::PanelBuf buf;
  ft::PanelFn panel = ft::pick_panel(fmt, cap);
  for (int64_t r0 = 0; r0 < rows; r0 += ft::kPanelRows) {
    ft::Panel p;
    panel(fmt, mat, r0, (int)ft::min64(ft::kPanelRows, rows - r0), cols, buf, &p);
    b.fn(p, a, M, out + r0, rows);
  }
  return b.isa;
}

// Tuning: how far ahead the SIMD kernels prefetch weights (bytes) and into which cache level
// (0 = L1, 1 = L2, 2 = L3); process-wide.
FT_API void ft_set_prefetch(int bytes, int level) { ft::set_prefetch(bytes, level); }

// x (K floats, K % 32 == 0) as int8 activations with the quantiser at or below `cap`: q (K),
// d (K / 32 block scales), gs (K / 4 sums of each group of four). Returns the tier used.
FT_API int ft_quantize_q8(int cap, const float* x, int64_t K, int8_t* q, float* d, int32_t* gs) {
  std::vector<float> dl(K / 4);
  std::vector<int32_t> gb(K / 4);
  int isa = ft::ISA_SCALAR;
  ft::pick_quantizer(cap, &isa)(x, K, q, d, dl.data(), gs, gb.data());
  return isa;
}

FT_API void* ft_executor_new(const int* cores, int n, int isa_cap, int spin_us) {
  std::vector<int> c(cores, cores + n);
  return new ft::Executor(c, isa_cap, spin_us);
}

FT_API void ft_executor_free(void* ex) { delete (ft::Executor*)ex; }

FT_API int ft_executor_threads(void* ex) { return ((ft::Executor*)ex)->threads(); }

FT_API int ft_executor_isa(void* ex) { return ((ft::Executor*)ex)->isa(); }

// int64s per worker that ft_worker_states writes (state, phase, ns in that state, jobs, items).
FT_API int ft_worker_fields() { return ft::Pool::kWorkerFields; }

// What each worker is doing: ft_worker_fields() int64s per worker, threads() workers.
FT_API void ft_worker_states(void* ex, int64_t* out) {
  ((ft::Executor*)ex)->worker_states(out);
}

// Job slots free now (Pool::kSlots when every submitted job has been waited for).
FT_API int ft_free_jobs(void* ex) { return ((ft::Executor*)ex)->free_jobs(); }

// Returns 0, or -1 with the reason in err. glu: null, or the clamped SwiGLU's parameters and
// the experts' biases (copied).
FT_API int ft_add_layer(void* ex, int layer, int E, int H, int I, int activation,
                        const GluDesc* glu, const ProjDesc* gate, const ProjDesc* up,
                        const ProjDesc* down, int act_mode, char* err, int err_len) {
  if (E <= 0 || H <= 0 || I <= 0) glu = nullptr;  // add_layer refuses the shape
  std::string e = ((ft::Executor*)ex)->add_layer(
      layer, E, H, I, activation, to_glu(glu, E, H, I), to_proj(*gate, E), to_proj(*up, E),
      to_proj(*down, E), act_mode);
  copy_error(e, err, err_len);
  return e.empty() ? 0 : -1;
}

// For proj 0/1/2 (gate/up/down) of a layer: its kernel's tier and activation kind.
FT_API int ft_layer_kernel(void* ex, int layer, int proj, int* isa, int* act) {
  const ft::Layer* L = ((ft::Executor*)ex)->layer(layer);
  if (!L || proj < 0 || proj > 2) return -1;
  const ft::Proj& p = proj == 0 ? L->gate : proj == 1 ? L->up : L->down;
  *isa = p.isa;
  *act = p.act;
  return 0;
}

// `signal` (may be NULL): a flag the pool sets to 1 once `out` is written.
FT_API int64_t ft_submit(void* ex, int layer, const float* x, const int64_t* ids,
                         const float* w, float* out, int T, int A, uint32_t* signal) {
  return ((ft::Executor*)ex)->submit(layer, x, ids, w, out, T, A, signal);
}

// A dense matrix under `id`: 0 or -1 with the reason in err.
FT_API int ft_add_linear(void* ex, int id, const ProjDesc* w, int act_mode, char* err, int len) {
  std::string e = ((ft::Executor*)ex)->add_linear(id, to_proj(*w, 1), act_mode);
  copy_error(e, err, len);
  return e.empty() ? 0 : -1;
}

// The tier and activation kind of linear `id`'s kernel.
FT_API int ft_linear_kernel(void* ex, int id, int* isa, int* act) {
  const ft::Proj* p = ((ft::Executor*)ex)->linear(id);
  if (!p) return -1;
  *isa = p->isa;
  *act = p->act;
  return 0;
}

// The tier of linear `id`'s batched kernel (jobs of ft_batch_vectors() vectors or more), -1
// when it has none; -2 for an unknown id.
FT_API int ft_linear_batch_isa(void* ex, int id) {
  const ft::Proj* p = ((ft::Executor*)ex)->linear(id);
  return p ? p->batch_isa : -2;
}

FT_API int ft_batch_vectors() { return ft::kBatchVectors; }

FT_API int64_t ft_submit_linear(void* ex, int id, const float* x, float* out, int T) {
  return ((ft::Executor*)ex)->submit_linear(id, x, out, T);
}

// submit + wait in one call, for callers that have nothing to overlap (a layer's synchronous
// path): the weight bytes read, or submit's negative code; the pool's time in ns.
FT_API int64_t ft_run(void* ex, int layer, const float* x, const int64_t* ids, const float* w,
                      float* out, int T, int A, int64_t* ns) {
  int64_t h = ((ft::Executor*)ex)->submit(layer, x, ids, w, out, T, A);
  return h < 0 ? h : ((ft::Executor*)ex)->wait(h, ns, nullptr);
}

// submit_linear + wait in one call (see ft_run).
FT_API int64_t ft_run_linear(void* ex, int id, const float* x, float* out, int T, int64_t* ns) {
  int64_t h = ((ft::Executor*)ex)->submit_linear(id, x, out, T);
  return h < 0 ? h : ((ft::Executor*)ex)->wait(h, ns, nullptr);
}

// One decoder layer of CPU float32 decode (csrc/decode_layer.cpp): x (B, H) updated in place;
// 0, or -1 when a pool job or a position is refused.
FT_API int ft_decode_layer(void* ex, const ft::DecodeLayer* d, const ft::DecodeStep* st,
                           float* x) {
  return ft::decode_layer(*(ft::Executor*)ex, *d, *st, x);
}

// A dense MLP's act(gate) * up (csrc/glu.cpp) on the calling thread.
FT_API void ft_glu(const float* g, int64_t g_stride, const float* u, int64_t u_stride,
                   int64_t T, int I, int act, float* out) {
  ft::glu(g, g_stride, u, u_stride, T, I, act, out);
}

// timing: null, or ft::TM_FIELDS int64s to fill (see ft::TimingField).
FT_API int64_t ft_wait(void* ex, int64_t handle, int64_t* ns, int64_t* timing) {
  return ((ft::Executor*)ex)->wait(handle, ns, timing);
}

FT_API int ft_timing_fields() { return ft::TM_FIELDS; }

// Profiling: time every item of later jobs (1) or not (0).
FT_API void ft_set_timing(void* ex, int on) { ((ft::Executor*)ex)->set_timing(on != 0); }

// Tuning: whether the thread in wait() runs items of its job (1, the default) or only blocks.
FT_API void ft_set_join(void* ex, int on) { ((ft::Executor*)ex)->set_join(on != 0); }

// Tuning: how later jobs split down_proj (ft::DownSplit: -1 auto, 0 rows, 1 experts); 0, or
// -1 for another value.
FT_API int ft_set_down_split(void* ex, int mode) {
  return ((ft::Executor*)ex)->set_down_split(mode) ? 0 : -1;
}

// Tuning: rows of I per gate/up work item of later jobs (0: the default); 0, or -1 when the
// count is not a multiple of 32 up to the limit.
FT_API int ft_set_gate_up_rows(void* ex, int rows) {
  return ((ft::Executor*)ex)->set_gate_up_rows(rows) ? 0 : -1;
}

// Linear jobs of `vectors` vectors or more run the batched kernels (0: none; the default is
// ft_batch_vectors()).
FT_API void ft_set_batch_from(void* ex, int vectors) {
  ((ft::Executor*)ex)->set_batch_from(vectors);
}

FT_API double ft_stream_read(void* ex, const void* buf, int64_t bytes, int reps) {
  return ((ft::Executor*)ex)->stream_read((const uint8_t*)buf, bytes, reps);
}
