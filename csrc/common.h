// Shared types of the CPU MoE kernels: formats, ISA tiers, weight and activation views, the
// kernel signature and the dispatch table. Helpers here are `static inline` so that each ISA
// translation unit, compiled with its own flags, keeps a private copy (no ODR mix-ups).
#pragma once

#include <cstdint>
#include <cstring>

// The engine thread's single-thread steps (attention_decode.cpp, rms_norm.cpp, rotary.cpp)
// are compiled once per vector width and picked by the CPU at load time. FT_ONE_TIER builds
// only the width of the compiler flags: tests/engine/test_native_tiers.py builds each width
// that way, since the CPU would otherwise always pick its widest.
#ifdef FT_ONE_TIER
#define FT_VECTOR_WIDTHS
#else
#define FT_VECTOR_WIDTHS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace ft {

// The C ABI's version: bump it with any change to a signature, struct or enum the Python side
// mirrors (freetoken/cpu/abi.py checks it, and the tables below, when it loads the library).
constexpr int ABI_VERSION = 19;

// Weight formats; the numbering is part of the C ABI (FORMATS in freetoken/cpu/abi.py).
enum Fmt : int {
  F_BF16 = 0,
  F_Q8_0 = 1,
  F_Q4_0 = 2,
  F_Q5_0 = 3,
  F_Q4_K = 4,
  F_Q5_K = 5,
  F_Q6_K = 6,
  F_MXFP4 = 7,
  F_NVFP4 = 8,
  F_FP8_BLOCK = 9,
  F_F32 = 10,
  F_COUNT = 11,
};

// Each format's name and block: weights per block along a row, and the block's bytes (the
// scales of nvfp4 and fp8_block live apart). The one table the kernels size rows by.
struct FmtInfo {
  const char* name;
  int block;
  int block_bytes;
};
constexpr FmtInfo FMT_INFO[F_COUNT] = {
    {"bf16", 1, 2},     {"q8_0", 32, 34},   {"q4_0", 32, 18},   {"q5_0", 32, 22},
    {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210}, {"mxfp4", 32, 17},
    {"nvfp4", 16, 8},   {"fp8_block", 1, 1}, {"f32", 1, 4},
};

// ISA tiers, lowest first; a tier may use every instruction of the tiers below it.
enum Isa : int {
  ISA_SCALAR = 0,
  ISA_AVX2 = 1,         // AVX2 + FMA + F16C
  ISA_AVX512 = 2,       // AVX-512 F, BW, VL, DQ
  ISA_AVX512_VNNI = 3,  // + VNNI (int8 dot products)
  ISA_AVX512_BF16 = 4,  // + BF16 dot products
  ISA_COUNT = 5,
};

// How a kernel reads its activation vectors.
enum ActKind : int {
  ACT_F32 = 0,   // float32
  ACT_Q8 = 1,    // int8 blocks of 32 with a float scale (q8_0-like)
  ACT_BF16 = 2,  // bfloat16
  ACT_COUNT = 3,
};

// One expert's projection matrix (rows x cols) in its own format.
struct Mat {
  const uint8_t* data;      // row r starts at data + r * row_bytes
  int64_t row_bytes;
  const uint8_t* scale;     // nvfp4: e4m3 (rows, cols/16); fp8_block: f32 (rows/128, cols/128)
  int64_t scale_row_bytes;  // bytes between rows of `scale` (per row; per 128 rows for fp8)
  float scale2;             // nvfp4: the global scale (weight_scale_2)
};

// Activation vectors of length K, in every representation a kernel may read. Vector v of a
// call is number vidx[v] (or v when vidx is null) of these arrays.
struct Act {
  int64_t K;
  const float* f;       // (n, K)
  const uint16_t* bf;   // (n, K) bfloat16 bits
  const int8_t* q;      // (n, K)
  const float* d;       // (n, K/32) block scales
  const float* dl;      // (n, K/4)  block scale repeated for each group of 4
  const int32_t* gs;    // (n, K/4)  sum of each group of 4 int8 values
  const int32_t* gb;    // (n, K/4)  -128 * gs: the bias that removes a +128 weight offset
};

// out[v * ldo + (r - r0)] = dot(row r of m, activation vidx[v]) for r in [r0, r1), v < n.
using GemvFn = void (*)(const Mat& m, int64_t cols, int64_t r0, int64_t r1, const Act& a,
                        const int32_t* vidx, int n, float* out, int64_t ldo);

// Reads `bytes` (a multiple of 64) of memory and returns something that depends on all of it.
using ReadFn = uint64_t (*)(const uint8_t* p, int64_t bytes);

// Quantise one vector of K floats (K % 32 == 0) to Q8 blocks (see Act); every tier gives the
// scalar twin's bits.
using QuantFn = void (*)(const float* x, int64_t K, int8_t* q, float* d, float* dl, int32_t* gs,
                         int32_t* gb);
// The scalar twin (activations.cpp).
void quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* dl, int32_t* gs,
                 int32_t* gb);

// kPanelRows rows of a matrix decoded for the batched kernels (panels.cpp): per sub-block of
// `sub` weights (16 or 32, within one 32-element activation block) small signed integers q,
// one float scale and, where the format has them, one min, so that
//   weight = scale * q - min.
// q is laid out as AMX tiles read it: the 4 weights 4k..4k+3 of row n in sub-block s at
// q[((s * sub / 4 + k) * kPanelRows + n) * 4]; rows past `rows` are zero.
constexpr int kPanelRows = 16;
struct Panel {
  int sub = 32;
  int64_t nsub = 0;
  int rows = 0;
  const int8_t* q = nullptr;
  const float* scale = nullptr;  // (nsub, kPanelRows)
  const float* min = nullptr;    // (nsub, kPanelRows), null for formats without mins
  const int32_t* qsum = nullptr;  // (nsub, kPanelRows) sum of each row's q in the sub-block
};

// out[m * ldo + n] for M Q8 activation vectors (a.q, a.d, a.gs) and the panel's rows n. Each
// output is, in sub-block order from 0 (the scalar twin in kernels_scalar.cpp),
//   acc = fma(float(dot_s), scale_s * d_m, acc);  acc = fma(min_s, -(d_m * float(sum_s)), acc)
// with dot_s the exact integer dot product of the sub-block and sum_s that of the activation
// values (the second step only where the format has mins): the same bits on every tier and
// for every M, as each vector's outputs depend on nothing but that vector.
using BatchFn = void (*)(const Panel& p, const Act& a, int M, float* out, int64_t ldo);

struct KernelTable {
  GemvFn fn[F_COUNT][ACT_COUNT][ISA_COUNT];
  BatchFn batch[F_COUNT][ISA_COUNT];
  ReadFn read[ISA_COUNT];
  QuantFn quant[ISA_COUNT];
};

// The scalar reference's integer decoding of unit u (a block; 256 weights for the k-quants) of
// row r: q[i] with the offset removed, and per-16 scales s[g] and mins mn[g] (weight = s q - mn).
void decode_int(int fmt, const Mat& m, int64_t r, int64_t u, int16_t* q, float* s, float* mn);

// How far ahead of the row being read the SIMD kernels prefetch weights (bytes); a tuning knob
// for the memory system. The defaults (8 KiB ahead into L2) beat 2 KiB into L1 by 10-25 % on
// the GPU machine's 16-core Xeon at 15 workers and on the 2-core development box
// (benchmarks/cpu_moe.py --prefetch sweep).
constexpr int kDefaultPrefetch = 8192;
constexpr int kDefaultPrefetchLevel = 1;
int prefetch_bytes();
// Which cache level the prefetches fill: 0 = L1 (T0), 1 = L2 (T1), 2 = L3 (T2).
int prefetch_level();
void set_prefetch(int bytes, int level);

// Each ISA translation unit fills the entries it implements.
void register_scalar(KernelTable& t);
void register_avx2(KernelTable& t);
void register_avx512(KernelTable& t);
void register_avx512_vnni(KernelTable& t);
void register_avx512_bf16(KernelTable& t);
// AMX (tiles of int8 dot products) where the CPU has it and the OS grants it: the batched
// kernels of the top tier (every AMX CPU has AVX512-BF16).
void register_amx(KernelTable& t);

static inline float fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline float bf16_to_f32(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaNs kept quiet (as ggml and freetoken.quant.floats.to_bf16).
static inline uint16_t f32_to_bf16(float f) {
  uint32_t n;
  std::memcpy(&n, &f, 4);
  if ((n & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((n >> 16) | 64);
  return (uint16_t)((n + 0x7FFF + ((n >> 16) & 1)) >> 16);
}

static inline float e4m3_to_f32(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 0) {
    v = (float)m * (1.0f / 512.0f);  // m/8 * 2^-6
  } else if (e == 15 && m == 7) {
    v = __builtin_nanf("");
  } else {
    uint32_t bits = (uint32_t)(e + 120) << 23 | (uint32_t)m << 20;
    std::memcpy(&v, &bits, 4);
  }
  return (b & 0x80) ? -v : v;
}

// 2^(e - 128) as float32, exact for every byte (0 and 1 give subnormals).
static inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

static inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Twice the e2m1 value of each 4-bit code (exact small integers).
static const int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K (and Q5_K) six-bit sub-block scale and min j (0..7) from the 12 packed bytes.
static inline void q4k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ft
