#include "expert_slots.h"

#include <algorithm>

namespace ft {

SlotLru::SlotLru(int32_t slots)
    : n_(slots), prev_(slots), next_(slots), head_(slots > 0 ? 0 : -1), tail_(slots - 1),
      owner_layer_(slots, -1), owner_expert_(slots, -1), mark_(slots, 0) {
  for (int32_t s = 0; s < slots; ++s) {
    prev_[s] = s - 1;
    next_[s] = s + 1 < slots ? s + 1 : -1;
  }
}

bool SlotLru::add_layer(int32_t layer, int64_t* table, int32_t experts) {
  if (layer < 0 || experts <= 0 || table == nullptr) return false;
  if ((size_t)layer >= layers_.size()) layers_.resize(layer + 1);
  layers_[layer] = Layer{table, experts};
  return true;
}

const SlotLru::Layer* SlotLru::layer_of(int32_t layer) const {
  if (layer < 0 || (size_t)layer >= layers_.size() || layers_[layer].table == nullptr)
    return nullptr;
  return &layers_[layer];
}

void SlotLru::touch(int32_t s) {
  if (s == tail_) return;
  // unlink
  if (prev_[s] >= 0) next_[prev_[s]] = next_[s]; else head_ = next_[s];
  prev_[next_[s]] = prev_[s];  // s is not the tail, so it has a next
  // append
  prev_[s] = tail_;
  next_[s] = -1;
  next_[tail_] = s;
  tail_ = s;
}

bool SlotLru::lookup(int32_t layer, const int64_t* experts, int32_t n, int64_t* slot_out) {
  const Layer* l = layer_of(layer);
  if (l == nullptr) return false;
  for (int32_t i = 0; i < n; ++i)
    if (experts[i] < 0 || experts[i] >= l->experts) return false;
  for (int32_t i = 0; i < n; ++i) {
    int64_t s = l->table[experts[i]];
    slot_out[i] = s >= 0 ? s : -1;
    if (s >= 0) touch((int32_t)s);
  }
  return true;
}

int SlotLru::admit(int32_t layer, const int64_t* experts, int32_t n, const int64_t* keep,
                   int32_t n_keep, int64_t* slots_out) {
  const Layer* l = layer_of(layer);
  if (l == nullptr) return -2;
  for (int32_t i = 0; i < n; ++i)
    if (experts[i] < 0 || experts[i] >= l->experts) return -2;
  if (++stamp_ == 0) {  // the stamp wrapped: no slot may look kept by an old call
    std::fill(mark_.begin(), mark_.end(), 0);
    stamp_ = 1;
  }
  for (int32_t i = 0; i < n_keep; ++i)
    if (keep[i] >= 0 && keep[i] < n_) mark_[keep[i]] = stamp_;
  int32_t from = head_;  // slots before it were kept or given already in this call
  for (int32_t i = 0; i < n; ++i) {
    int32_t v = from;
    while (v >= 0 && mark_[v] == stamp_) v = next_[v];
    if (v < 0) return -1;
    from = next_[v];  // v moves to the tail: the scan goes on after it
    if (owner_layer_[v] >= 0) layers_[owner_layer_[v]].table[owner_expert_[v]] = -1;
    owner_layer_[v] = layer;
    owner_expert_[v] = (int32_t)experts[i];
    l->table[experts[i]] = v;
    touch(v);
    mark_[v] = stamp_;
    slots_out[i] = v;
  }
  return 0;
}

int32_t SlotLru::route(int32_t layer, const int64_t* flat, int32_t n_flat, int64_t* needed,
                       int64_t* uses, int64_t* slot) {
  const Layer* l = layer_of(layer);
  if (l == nullptr) return -1;
  scratch_.assign(flat, flat + n_flat);
  std::sort(scratch_.begin(), scratch_.end());
  int32_t k = 0;
  for (int32_t i = 0; i < n_flat; ++i) {
    int64_t e = scratch_[i];
    if (e < 0 || e >= l->experts) return -1;
    if (k > 0 && needed[k - 1] == e) {
      ++uses[k - 1];
    } else {
      needed[k] = e;
      uses[k] = 1;
      ++k;
    }
  }
  return lookup(layer, needed, k, slot) ? k : -1;
}

int32_t SlotLru::split(int32_t layer, const int64_t* flat, int32_t n_flat,
                       const int64_t* needed, const int64_t* uses, const int64_t* slot,
                       int32_t n_needed, int32_t n_fetch, int64_t* fetched,
                       int64_t* fetched_slots, int64_t* cpu_ids) {
  const Layer* l = layer_of(layer);
  if (l == nullptr) return -2;
  for (int32_t i = 0; i < n_flat; ++i)
    if (flat[i] < 0 || flat[i] >= l->experts) return -2;
  // misses by use, descending (ties: lower id first), as indices into needed
  std::vector<int32_t>& misses = misses_;
  std::vector<int64_t>& keep = keep_;
  misses.clear();
  keep.clear();
  for (int32_t k = 0; k < n_needed; ++k) {
    if (slot[k] < 0) misses.push_back(k); else keep.push_back(slot[k]);
  }
  std::stable_sort(misses.begin(), misses.end(),
                   [&](int32_t a, int32_t b) { return uses[a] > uses[b]; });
  int32_t n = std::max(0, std::min(n_fetch, (int32_t)misses.size()));
  for (int32_t i = 0; i < n; ++i) fetched[i] = needed[misses[i]];
  std::sort(fetched, fetched + n);
  int given = admit(layer, fetched, n, keep.data(), (int32_t)keep.size(), fetched_slots);
  if (given < 0) return given;
  int32_t n_cpu = (int32_t)misses.size() - n;
  if (cpu_ids != nullptr) {
    scratch_.assign(l->experts, 0);  // 1: the CPU's
    for (size_t i = n; i < misses.size(); ++i) scratch_[needed[misses[i]]] = 1;
    for (int32_t i = 0; i < n_flat; ++i) cpu_ids[i] = scratch_[flat[i]] ? flat[i] : -1;
  }
  return n_cpu;
}

int32_t SlotLru::rank(int32_t layer, const int64_t* picks, int32_t n, int64_t* predicted,
                      int64_t* slot) {
  const Layer* l = layer_of(layer);
  if (l == nullptr) return -1;
  for (int32_t i = 0; i < n; ++i)
    if (picks[i] < 0 || picks[i] >= l->experts) return -1;
  // distinct ids ascending, then a stable sort by count keeps ties in ascending order
  scratch_.assign(picks, picks + n);
  std::sort(scratch_.begin(), scratch_.end());
  counts_.clear();
  int32_t k = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (k > 0 && predicted[k - 1] == scratch_[i]) {
      ++counts_[k - 1];
    } else {
      predicted[k++] = scratch_[i];
      counts_.push_back(1);
    }
  }
  misses_.resize(k);
  for (int32_t i = 0; i < k; ++i) misses_[i] = i;  // order of the distinct ids
  std::stable_sort(misses_.begin(), misses_.end(),
                   [&](int32_t a, int32_t b) { return counts_[a] > counts_[b]; });
  scratch_.assign(predicted, predicted + k);
  for (int32_t i = 0; i < k; ++i) predicted[i] = scratch_[misses_[i]];
  lookup(layer, predicted, k, slot);
  ranked_.clear();
  for (int32_t i = 0; i < k; ++i)
    if (slot[i] < 0) ranked_.push_back(predicted[i]);
  ranked_misses_ = (int32_t)ranked_.size();
  for (int32_t i = 0; i < k; ++i)
    if (slot[i] >= 0) ranked_.push_back(slot[i]);
  ranked_layer_ = layer;
  return k;
}

int32_t SlotLru::admit_ranked(int32_t n_take, const int64_t* keep, int32_t n_keep,
                              int64_t* fetched, int64_t* slots_out) {
  if (ranked_layer_ < 0) return 0;
  // the busy slots, each counted once: keep's and the ranked hits'
  keep_.clear();
  for (int32_t i = 0; i < n_keep; ++i)
    if (keep[i] >= 0 && keep[i] < n_) keep_.push_back(keep[i]);
  keep_.insert(keep_.end(), ranked_.begin() + ranked_misses_, ranked_.end());
  std::sort(keep_.begin(), keep_.end());
  int32_t busy = (int32_t)(std::unique(keep_.begin(), keep_.end()) - keep_.begin());
  int32_t n = std::max(0, std::min({n_take, ranked_misses_, n_ - busy}));
  std::copy(ranked_.begin(), ranked_.begin() + n, fetched);
  int given = admit(ranked_layer_, fetched, n, keep_.data(), busy, slots_out);
  ranked_layer_ = -1;
  return given < 0 ? -1 : n;
}

void SlotLru::order(int64_t* out) const {
  int32_t i = 0;
  for (int32_t s = head_; s >= 0; s = next_[s]) out[i++] = s;
}

void SlotLru::owners(int64_t* layer_out, int64_t* expert_out) const {
  for (int32_t s = 0; s < n_; ++s) {
    layer_out[s] = owner_layer_[s];
    expert_out[s] = owner_expert_[s];
  }
}

}  // namespace ft
