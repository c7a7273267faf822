// Software prefetch helpers shared by the SIMD tiers (SSE's prefetch exists on every x86 tier).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace ft {

// One line into cache level `level` (0 = L1, 1 = L2, else L3).
static inline void prefetch(const void* p, int level) {
  switch (level) {
    case 0: _mm_prefetch((const char*)p, _MM_HINT_T0); break;
    case 1: _mm_prefetch((const char*)p, _MM_HINT_T1); break;
    default: _mm_prefetch((const char*)p, _MM_HINT_T2); break;
  }
}

// The first `ahead` bytes of a region about to be read, into the level the loop prefetches to:
// the in-loop prefetches only cover what lies `ahead` beyond the current position, and the
// regions here are often short.
static inline void prefetch_start(const uint8_t* p, int64_t bytes, int64_t ahead, int level) {
  for (int64_t off = 0; off < ahead && off < bytes; off += 64) prefetch(p + off, level);
}

// Rows the grouped row kernels read at once for NV vectors (each activation load serves them
// all; more vectors leave fewer registers).
constexpr int group_rows(int nv) { return nv <= 2 ? 4 : 2; }

// How far ahead such a kernel prefetches: at least one whole group of `group_bytes`, so that a
// group's rows are all in flight before it starts (its R rows are read side by side, and a
// lead shorter than the group would reach the last rows late). 0 leaves prefetching off.
static inline int64_t group_lead(int64_t ahead, int64_t group_bytes) {
  return ahead > 0 && group_bytes > ahead ? group_bytes : ahead;
}

}  // namespace ft
