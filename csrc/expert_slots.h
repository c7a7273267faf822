// The expert cache's slot decisions (freetoken/moe/slot_pool.py's SlotPool is the twin):
// one LRU over a pool's slots, each layer's table expert -> slot, and a decode call's plan
// (its routed experts, hits and misses, which misses are fetched into which victim slots and
// which go to the CPU) in two calls instead of Python loops over sets and dicts.
#pragma once
#include <cstdint>
#include <vector>

namespace ft {

class SlotLru {
 public:
  explicit SlotLru(int32_t slots);

  // Layer `layer` reads and writes `table` (experts entries, the caller's memory, -1: not
  // cached). False for a bad layer id or size.
  bool add_layer(int32_t layer, int64_t* table, int32_t experts);

  // Hits (slot, marked most recently used in the order given) and misses (-1) of `experts`.
  // False if an id is out of range or the layer unknown.
  bool lookup(int32_t layer, const int64_t* experts, int32_t n, int64_t* slot_out);

  // Each of `experts` (not cached) gets the least recently used slot not in `keep` (and not
  // given earlier in this call), evicting its expert; it becomes most recently used. Returns
  // 0; -1 when no slot is left (the experts before it keep theirs, as the twin does); -2 for
  // an unknown layer or an id out of range (nothing changed).
  int admit(int32_t layer, const int64_t* experts, int32_t n, const int64_t* keep,
            int32_t n_keep, int64_t* slots_out);

  // A call's routed ids `flat` -> its experts, ascending (needed), how often each is routed
  // (uses) and its slot or -1 (slot), hits marked most recently used in that order. Returns
  // how many experts, or -1 for an id out of range.
  int32_t route(int32_t layer, const int64_t* flat, int32_t n_flat, int64_t* needed,
                int64_t* uses, int64_t* slot);

  // Of route's misses, the n_fetch most used (ties: lower id) are fetched: given slots in
  // ascending expert order (the hits' slots kept), written to fetched / fetched_slots; the
  // rest go to the CPU: cpu_ids (if not null) gets each routed id that does, -1 elsewhere.
  // Returns how many went to the CPU, -1 when no slot is left, -2 for an id out of range.
  int32_t split(int32_t layer, const int64_t* flat, int32_t n_flat, const int64_t* needed,
                const int64_t* uses, const int64_t* slot, int32_t n_needed, int32_t n_fetch,
                int64_t* fetched, int64_t* fetched_slots, int64_t* cpu_ids);

  // Look-ahead's ranking: the ids `picks` (the next router's picks of every token) as
  // distinct experts, most picked first (ties: lower id), in `predicted`; each one's slot or
  // -1 in `slot`, hits marked most recently used in that order. Returns how many experts, or
  // -1 for an id out of range or an unknown layer (nothing changed). The misses, in that
  // order, wait for admit_ranked.
  int32_t rank(int32_t layer, const int64_t* picks, int32_t n, int64_t* predicted,
               int64_t* slot);

  // The first of the last rank's misses (at most n_take, and at most the slots that are
  // neither in `keep` (negative entries ignored) nor that rank's hits) admitted as admit
  // does, into fetched / slots_out. Returns how many, or -1 when no slot was left.
  int32_t admit_ranked(int32_t n_take, const int64_t* keep, int32_t n_keep, int64_t* fetched,
                       int64_t* slots_out);

  // Slots from least to most recently used; each slot's owner (layer, expert; -1 if none).
  void order(int64_t* out) const;
  void owners(int64_t* layer_out, int64_t* expert_out) const;

 private:
  struct Layer {
    int64_t* table = nullptr;
    int32_t experts = 0;
  };
  void touch(int32_t s);  // s becomes most recently used
  const Layer* layer_of(int32_t layer) const;

  int32_t n_;
  std::vector<int32_t> prev_, next_;  // the LRU list; head_ least, tail_ most recently used
  int32_t head_, tail_;
  std::vector<int32_t> owner_layer_, owner_expert_;
  std::vector<uint32_t> mark_;  // keep sets: slot s is kept while mark_[s] == stamp_
  uint32_t stamp_ = 0;
  std::vector<Layer> layers_;
  std::vector<int64_t> scratch_;  // route's sorted ids, split's CPU flags per expert
  std::vector<int32_t> misses_;   // split's misses (indices into needed)
  std::vector<int64_t> keep_;     // split's hit slots
  std::vector<int32_t> counts_;   // rank's picks per expert
  std::vector<int64_t> ranked_;   // rank's misses (in rank order), then its hits' slots
  int32_t ranked_misses_ = 0;
  int32_t ranked_layer_ = -1;
};

}  // namespace ft
