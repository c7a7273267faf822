// Expert rows copied into cache slots in one call (see row_copy.cpp).
#pragma once
#include <cstdint>

namespace ft {

// Entry points of the process's CUDA driver (all null: host memory, plain memcpy).
struct RowCopyApi {
  void* memcpy_async;       // cuMemcpyAsync
  void* event_record;       // cuEventRecord
  void* stream_wait_event;  // cuStreamWaitEvent
  void* event_query;        // cuEventQuery
  void* event_synchronize;  // cuEventSynchronize
};

// Row dst_rows[i] of dst gets row src_rows[i] of src (row_bytes each), on copy_stream after
// the compute stream's work so far (ev_ready, if given); ev_start / ev_end (if given) are
// recorded around the copies, and with compute_waits the compute stream waits for ev_end.
struct RowCopy {
  uint8_t* dst;
  int64_t dst_stride;
  const uint8_t* src;
  int64_t src_stride;
  int64_t row_bytes;
  const int32_t* dst_rows;
  const int32_t* src_rows;
  int32_t n;
  int32_t compute_waits;
  void* compute_stream;
  void* copy_stream;
  void* ev_ready;
  void* ev_start;
  void* ev_end;
};

// 0, or the CUDA driver's error code (-1: an incomplete api).
int copy_rows(const RowCopyApi& api, const RowCopy& c);

// n copies of bytes[i] from src[i] to dst[i] on stream, in order; with an event ``done``
// the host then waits for them as wait_event does. 0, or the CUDA driver's error code.
int copy_spans(const RowCopyApi& api, void* stream, int n, const uint64_t* dst,
               const uint64_t* src, const int64_t* bytes, void* done, int spin_us);

// The host waits for the work queued on stream so far: event (made with blocking sync) is
// recorded there and polled for at most spin_us microseconds, then waited for asleep, so a
// long wait costs the thread spin_us of CPU time, not the whole wait. 0, or the driver's
// error code (-1: an incomplete api).
int wait_event(const RowCopyApi& api, void* event, void* stream, int spin_us);

}  // namespace ft
