// The fused expert op and the executor that runs it on the pool.
//
// One call computes, for T tokens routed to A experts each,
//   out[t] = sum_a w[t, a] * down_e(glu(gate_e(x[t]), up_e(x[t]))),  e = ids[t, a],
// with glu(g, u) = act(g) * u, or GPT-OSS's clamped form (ExpertGlu); biased experts add each
// projection's bias to its output before the next step (down's before the weighting).
// reading each routed expert's weights once however many tokens use it. ids < 0 are skipped
// (their pairs are computed elsewhere). Phases: 0 prepares x in the kernels' activation
// formats (per token), 1 runs gate and up and the activation (per expert and chunk of I rows),
// 2 runs down, split one of two ways (DownSplit); either way the pairs are summed in one fixed
// order, so the result does not depend on the number of threads or the split.
#pragma once

#include <cmath>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "panels.h"
#include "dispatch.h"
#include "thread_pool.h"

namespace ft {

enum Activation : int { ACTV_SILU = 0, ACTV_GELU_TANH = 1, ACTV_GELU = 2, ACTV_SWIGLU_OAI = 3 };

// The gate's activation, for the experts and the dense MLPs alike (one definition: one set of
// bits whichever computes it).
inline float activate(int kind, float g) {
  switch (kind) {
    case ACTV_GELU_TANH:
      return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case ACTV_GELU:
      return 0.5f * g * (1.0f + std::erf(g * 0.7071067811865476f));
    default:
      return g / (1.0f + std::exp(-g));
  }
}

// GPT-OSS's experts (ACTV_SWIGLU_OAI): g' = min(g, limit), u' = clamp(u, -limit, limit),
// glu = (u' + 1) * g' * sigmoid(alpha * g'); and each projection's bias, float32, (E, I) for
// gate and up and (E, H) for down, copied in (empty: none).
struct ExpertGlu {
  float alpha = 0, limit = 0;
  std::vector<float> gate_bias, up_bias, down_bias;
};

inline float clamped_swiglu(float alpha, float limit, float g, float u) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : u < -limit ? -limit : u;
  return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
}

// How phase 2 splits down_proj over the workers.
//   DOWN_ROWS: an item is a chunk of H rows of every active expert, weighted and summed into
//     out in place. Each item reads a short run of every expert's rows.
//   DOWN_EXPERTS: an item is a chunk of rows of one expert, written per pair to a (P, H)
//     buffer; the item that completes a chunk of rows (the last of the experts to finish it)
//     sums the pairs there. Longer runs of contiguous weights, P x H floats of scratch: the
//     decode split.
//   DOWN_AUTO: DOWN_EXPERTS up to kExpertSplitPairs pairs, else DOWN_ROWS.
enum DownSplit : int { DOWN_AUTO = -1, DOWN_ROWS = 0, DOWN_EXPERTS = 1 };
constexpr int64_t kExpertSplitPairs = 64;
constexpr int kMaxGateUpRows = 128;

// Executor::wait's timing record (nanoseconds from the job's publish): its first item's start,
// each phase's end, each phase's time inside items summed over workers (with timing on, else
// 0), and the time down items waited for an expert's gate/up.
enum TimingField : int { TM_START = 0, TM_END = 1, TM_BUSY = 5, TM_AWAIT = 9, TM_FIELDS = 10 };
static_assert(TM_BUSY == TM_END + kMaxPhases && TM_AWAIT == TM_BUSY + kMaxPhases,
              "cpu/jobs.py JobTiming reads the record in this layout");

// One projection of all experts of a layer.
struct Proj {
  int fmt = 0;
  int64_t rows = 0, cols = 0;
  std::vector<Mat> experts;
  int64_t expert_bytes = 0;  // bytes read per expert (data and scales)
  GemvFn fn = nullptr;
  int act = ACT_F32;
  int isa = ISA_SCALAR;
  BatchFn batch = nullptr;  // a dense matrix's batched kernel (kBatchVectors or more), if any
  int batch_isa = -1;
};

// A dense matrix's job with at least this many vectors runs its batched kernel (panels), where
// its format has one: its outputs then differ from the row kernels' in the last bits, and
// depend on nothing but their own vector (not on T). Fewer run the row kernels.
constexpr int kBatchVectors = 16;

struct Layer {
  int E = 0, H = 0, I = 0, activation = ACTV_SILU;
  ExpertGlu glu;
  Proj gate, up, down;
  bool x_needs[ACT_COUNT] = {};  // representations of x that gate/up read
};

// Scratch of one job; grows to the largest job seen, never shrinks.
struct Scratch {
  std::unique_ptr<uint8_t[]> mem;  // size + 64 bytes, used from its first 64-byte boundary
  size_t size = 0;
  // Grow to hold n 64-byte-aligned parts of sizes[i] bytes; part[i] is null where sizes[i] is 0.
  void carve(const size_t* sizes, int n, uint8_t** part);
};

struct Job {
  const Layer* L = nullptr;
  QuantFn quant = nullptr;
  const float* x = nullptr;
  float* out = nullptr;
  int T = 0, nthreads = 1;
  int n_active = 0;
  int64_t c1 = 32, c2 = 32, chunks1 = 0;
  int64_t weight_bytes = 0;
  int32_t* active = nullptr;  // (n_active) expert ids, ascending
  int32_t* start = nullptr;   // (n_active + 1) pair ranges per active expert
  int32_t* ptok = nullptr;    // (P) token of each pair
  float* pw = nullptr;        // (P) routing weight of each pair
  int32_t* count = nullptr;   // (E) counting-sort buffer
  int32_t* ready = nullptr;   // (n_active) gate/up chunks finished per active expert (atomic)
  uint32_t sleepers = 0;      // down items asleep on a ready counter (atomic)
  int64_t await_ns = 0;       // time down items waited on ready counters (atomic)
  int64_t P = 0;              // routed pairs
  int down = DOWN_ROWS;       // the phase-2 split (DownSplit)
  int64_t chunks2 = 0;        // DOWN_EXPERTS: down items per expert
  float* y = nullptr;         // DOWN_EXPERTS: (P, H) each pair's down output
  int32_t* rows_done = nullptr;  // DOWN_EXPERTS: (chunks2) experts done per chunk (atomic)
  Act xa{}, ha{};             // x (T, H) and h (P, I) representations
  float* hf = nullptr;
  uint16_t* hbf = nullptr;
  int8_t* hq = nullptr;
  float *hd = nullptr, *hdl = nullptr;
  int32_t *hgs = nullptr, *hgb = nullptr;
  Scratch scratch;
};

// One dense matrix (rows x cols) multiplied by T vectors on the pool: phase 0 encodes the
// vectors in the kernel's activation format (per vector), phase 1 runs chunks of rows.
struct LinearJob {
  const Proj* W = nullptr;
  QuantFn quant = nullptr;
  const float* x = nullptr;
  float* out = nullptr;
  int T = 0;
  int64_t chunk = 64, chunks = 0;
  bool batched = false;  // phase 1 items are panels of kPanelRows rows (W->batch)
  PanelFn panel = nullptr;  // their decoder
  Act xa{};
  int32_t* tok = nullptr;  // (T) 0..T-1, the vector index of each output row block
  Scratch scratch;
};

// Elements per block of a format (rows must hold whole blocks), and its name.
int64_t block_of(int fmt);
const char* fmt_name(int fmt);

// Scratch bytes for n vectors of length K in the representations a kernel may need, in Act's
// order: bf16, q, d, dl, gs, gb (0 where not needed); and the Act over floats f and those parts.
constexpr int kActParts = 6;
void act_sizes(int64_t n, int64_t K, bool bf16, bool q8, size_t* sizes);
Act act_view(int64_t K, const float* f, uint8_t* const* parts);

// Write vector t of `a` (length a.K) from the floats x in the representation `act` needs,
// quantising with `quant` where that is Q8.
void encode_act(const float* x, int act, const Act& a, int64_t t, QuantFn quant);

// One work item of a Job (expert_items.cpp): ctx is the Job, phase and item as published.
void run_expert_item(void* ctx, int phase, int64_t item, int worker);

class Executor {
 public:
  Executor(const std::vector<int>& cores, int isa_cap, int spin_us);
  ~Executor() = default;

  int threads() const { return pool_.threads(); }
  int isa() const { return isa_; }

  // act_mode: -1 picks per projection (the fastest tier; F32 on ties), else an ActKind; f32
  // weights read F32 activations whatever the mode. `glu` holds ACTV_SWIGLU_OAI's parameters
  // and any biases (their sizes are checked against E, H and I).
  // Returns an empty string or what was wrong.
  std::string add_layer(int layer, int E, int H, int I, int activation, ExpertGlu glu,
                        Proj gate, Proj up, Proj down, int act_mode);
  const Layer* layer(int layer) const;

  // Returns a handle to wait on; -1 for an unknown layer, -2 for an expert id >= E.
  // Thread-safe; blocks only while Pool::kSlots jobs are unwaited. `signal`: a flag set to 1
  // once `out` is written (Pool::publish), for a decode graph that waits on it.
  int64_t submit(int layer, const float* x, const int64_t* ids, const float* w, float* out,
                 int T, int A, uint32_t* signal = nullptr);
  // Block until the job is done (once per handle); returns the weight bytes it read, with its
  // run time in *ns and its TM_FIELDS timing record in timing when those are given.
  int64_t wait(int64_t handle, int64_t* ns = nullptr, int64_t* timing = nullptr);
  // Time every item of later jobs (see TimingField); a profiling aid, off by default.
  void set_timing(bool on) { pool_.set_timing(on); }
  // Pool::kWorkerFields int64s per worker (Pool::worker_states).
  void worker_states(int64_t* out) const { pool_.worker_states(out); }
  // Job slots free now: a job submitted and never waited for keeps its slot.
  int free_jobs() const { return pool_.free_slots(); }
  // Whether the thread in wait() runs items of its job too (the default) or only blocks.
  void set_join(bool on) { join_ = on; }
  // The phase-2 split of later jobs (DownSplit); false for a value that is none.
  bool set_down_split(int mode) {
    if (mode < DOWN_AUTO || mode > DOWN_EXPERTS) return false;
    down_split_ = mode;
    return true;
  }
  // Rows of I per gate/up item of later jobs: a multiple of 32 up to kMaxGateUpRows, or 0 for
  // the default (the most that leaves each worker about three items). False if out of range.
  // Linear jobs of at least `vectors` vectors run the batched kernels (0: none does). The
  // engine sets it per forward so that a request's kernel does not depend on what is batched
  // with it: 1 for a prompt's chunks, 0 for decode steps.
  void set_batch_from(int vectors) { batch_from_ = vectors < 0 ? 0 : vectors; }
  bool set_gate_up_rows(int rows) {
    if (rows < 0 || rows % 32 || rows > kMaxGateUpRows) return false;
    gate_up_rows_ = rows;
    return true;
  }

  // A dense matrix (one Proj of one "expert"): out = x @ W^T for T vectors of length cols.
  std::string add_linear(int id, Proj w, int act_mode);
  const Proj* linear(int id) const;
  // Returns a handle for wait(); -1 for an unknown id. Thread-safe like submit.
  int64_t submit_linear(int id, const float* x, float* out, int T);

  // Seconds to read `bytes` of buf `reps` times with all workers (a stream-read ceiling).
  double stream_read(const uint8_t* buf, int64_t bytes, int reps);


 private:
  std::string set_kernel(Proj& p, int act_mode);

  Pool pool_;
  int isa_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::unique_ptr<Proj>> linears_;
  Job jobs_[Pool::kSlots];  // one per pool slot
  LinearJob linear_jobs_[Pool::kSlots];
  int64_t bytes_[Pool::kSlots] = {};  // weight bytes the slot's job reads
  std::mutex layers_mu_;
  std::atomic<int> down_split_{DOWN_AUTO};
  std::atomic<int> gate_up_rows_{0};
  std::atomic<int> batch_from_{kBatchVectors};
  std::atomic<bool> join_{true};
  QuantFn quant_;
};

}  // namespace ft
