// Software prefetch helpers shared by the row kernels and the expert op's work items
// (__builtin_prefetch: prefetcht0/t1/t2 on x86, whatever the target has elsewhere).
#pragma once

#include <cstdint>

namespace ft {

// One line into cache level `level` (0 = L1, 1 = L2, else L3).
static inline void prefetch(const void* p, int level) {
  switch (level) {
    case 0: __builtin_prefetch(p, 0, 3); break;
    case 1: __builtin_prefetch(p, 0, 2); break;
    default: __builtin_prefetch(p, 0, 1); break;
  }
}

// The first `ahead` bytes of a region about to be read, into the level the loop prefetches to:
// the in-loop prefetches only cover what lies `ahead` beyond the current position, and the
// regions here are often short.
static inline void prefetch_start(const uint8_t* p, int64_t bytes, int64_t ahead, int level) {
  for (int64_t off = 0; off < ahead && off < bytes; off += 64) prefetch(p + off, level);
}

}  // namespace ft
