// Expert rows host -> device (or host -> host) queued in one call: what a cache miss costs on
// the host. CUDA is not linked: the caller passes the CUDA driver's entry points (the driver
// the process already loaded, whose streams and events torch's are), so this library builds
// and runs without CUDA, where the same call is a plain memcpy per run of rows.
#include <chrono>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "row_copy.h"

namespace ft {

namespace {

// The CUDA driver's signatures for the entry points used (addresses are unified, so a copy
// needs no direction).
using MemcpyAsync = int (*)(uint64_t dst, uint64_t src, size_t bytes, void* stream);
using EventRecord = int (*)(void* event, void* stream);
using StreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);
using EventQuery = int (*)(void* event);
using EventSynchronize = int (*)(void* event);
constexpr int NOT_READY = 600;  // CUDA_ERROR_NOT_READY: cuEventQuery's "not yet"

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

}  // namespace

int copy_rows(const RowCopyApi& api, const RowCopy& c) {
  auto copy = (MemcpyAsync)api.memcpy_async;
  auto record = (EventRecord)api.event_record;
  auto wait = (StreamWaitEvent)api.stream_wait_event;
  if (copy && (!record || !wait)) return -1;
  int err = 0;
  if (copy && c.ev_ready) {  // the copies come after the compute stream's work so far
    if ((err = record(c.ev_ready, c.compute_stream))) return err;
    if ((err = wait(c.copy_stream, c.ev_ready, 0))) return err;
  }
  if (copy && c.ev_start && (err = record(c.ev_start, c.copy_stream))) return err;
  for (int i = 0; i < c.n;) {
    // a run of rows consecutive on both sides is one copy
    int j = i + 1;
    while (j < c.n && c.dst_rows[j] == c.dst_rows[j - 1] + 1 &&
           c.src_rows[j] == c.src_rows[j - 1] + 1)
      ++j;
    uint8_t* dst = c.dst + c.dst_rows[i] * c.dst_stride;
    const uint8_t* src = c.src + c.src_rows[i] * c.src_stride;
    size_t bytes = (size_t)(j - i) * c.row_bytes;
    bool dense = c.dst_stride == c.row_bytes && c.src_stride == c.row_bytes;
    if (!dense) j = i + 1, bytes = c.row_bytes;  // strided rows: one at a time
    if (copy) {
      if ((err = copy((uintptr_t)dst, (uintptr_t)src, bytes, c.copy_stream))) return err;
    } else {
      std::memcpy(dst, src, bytes);
    }
    i = j;
  }
  if (copy && c.ev_end) {
    if ((err = record(c.ev_end, c.copy_stream))) return err;
    if (c.compute_waits && (err = wait(c.compute_stream, c.ev_end, 0))) return err;
  }
  return 0;
}

int copy_spans(const RowCopyApi& api, void* stream, int n, const uint64_t* dst,
               const uint64_t* src, const int64_t* bytes, void* done, int spin_us) {
  auto copy = (MemcpyAsync)api.memcpy_async;
  int err = 0;
  for (int i = 0; i < n; ++i) {
    if (bytes[i] <= 0) continue;
    if (copy) {
      if ((err = copy(dst[i], src[i], (size_t)bytes[i], stream))) return err;
    } else {
      std::memcpy((void*)(uintptr_t)dst[i], (const void*)(uintptr_t)src[i], (size_t)bytes[i]);
    }
  }
  return copy && done ? wait_event(api, done, stream, spin_us) : 0;
}

int wait_event(const RowCopyApi& api, void* event, void* stream, int spin_us) {
  auto record = (EventRecord)api.event_record;
  auto query = (EventQuery)api.event_query;
  auto sleep = (EventSynchronize)api.event_synchronize;
  if (!record || !query || !sleep) return -1;
  int err = record(event, stream);
  if (err) return err;
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  while ((err = query(event)) == NOT_READY) {
    if (std::chrono::steady_clock::now() >= until) return sleep(event);
    relax();
  }
  return err;
}

}  // namespace ft
