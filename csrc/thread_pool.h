// A pool of pinned workers that run phased jobs. A job is a few phases of independent items;
// workers take items with an atomic counter and meet at a barrier between phases. Jobs live in
// a ring of kSlots preallocated slots, so submitting allocates nothing. Every wait spins for a
// bounded time and then blocks on a futex.
//
// Threads: reserve/publish may be called from several threads if the caller serialises them
// (the executor holds a mutex); wait and release may be called from any thread, once per
// ticket, and every published ticket must be waited and released.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace ft {

// A futex word and the number of threads sleeping on it.
struct Word {
  std::atomic<uint32_t> v{0};
  std::atomic<uint32_t> sleepers{0};
};

using ItemFn = void (*)(void* ctx, int phase, int64_t item, int worker);

constexpr int kMaxPhases = 3;

class Pool {
 public:
  static constexpr int kSlots = 16;

  // One worker per entry of `cores` (pinned there; -1 leaves a worker unpinned).
  Pool(const std::vector<int>& cores, int spin_us);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return (int)workers_.size(); }

  // The next ticket, once its slot is free; the caller then fills its context.
  uint64_t reserve();
  // Start ticket's job: counts[p] items in phase p, run as fn(ctx, p, item, worker).
  void publish(uint64_t ticket, const int64_t* counts, int phases, ItemFn fn, void* ctx);
  // Block until ticket's job is done.
  void wait(uint64_t ticket);
  // Hand ticket's slot back (after wait).
  void release(uint64_t ticket);

 private:
  struct alignas(64) Slot {
    Word state;  // kFree, kReady, kDone
    Word exited;  // workers that have left this slot's job
    std::atomic<int64_t> next[kMaxPhases];
    Word done[kMaxPhases];  // items finished, per phase (low 32 bits)
    int64_t count[kMaxPhases];
    int phases = 0;
    ItemFn fn = nullptr;
    void* ctx = nullptr;
  };
  enum : uint32_t { kFree = 0, kReady = 1, kDone = 2 };

  void worker_main(int index, int core);
  void run(Slot& s, int worker);

  std::vector<Slot> slots_;
  std::vector<std::thread> workers_;
  Word submitted_;  // tickets published so far (mod 2^32)
  std::atomic<bool> stop_{false};
  uint64_t next_ticket_ = 0;
  int64_t spin_ns_;
};

}  // namespace ft
