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

}  // namespace ft
