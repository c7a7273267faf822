// How the grouped row kernels (int8 activations on the AVX2 and VNNI tiers, AVX512-BF16)
// walk a matrix's rows: R adjacent rows at once, so each activation load serves R rows, the
// last few rows one by one; the prefetch level as a template argument, so its switch stays
// out of the loops.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.h"
#include "prefetch.h"

namespace ft {

// What a row group reads besides its rows where a format keeps its scales apart (nvfp4): the
// group's first scale row, the bytes from one scale row to the next, and the global scale the
// row sums are multiplied by (1 for every other format, which leaves their bits alone).
struct Apart {
  const uint8_t* scales = nullptr;
  int64_t scale_row_bytes = 0;
  float scale2 = 1.0f;
};

// The Apart of the group starting at `row` of m (nothing unless `apart`).
static inline Apart apart_at(const Mat& m, const uint8_t* row, bool apart) {
  if (!apart) return {};
  const int64_t r = (row - m.data) / m.row_bytes;
  return {m.scale + r * m.scale_row_bytes, m.scale_row_bytes, m.scale2};
}

// Rows read at once for NV vectors (more vectors leave fewer registers).
constexpr int group_rows(int nv) { return nv <= 2 ? 4 : 2; }

// How far ahead a grouped kernel prefetches: at least one whole group of `group_bytes`, so that
// a group's rows are all in flight before it starts (its R rows are read side by side, and a
// lead shorter than the group would reach the last rows late). 0 leaves prefetching off.
static inline int64_t group_lead(int64_t ahead, int64_t group_bytes) {
  return ahead > 0 && group_bytes > ahead ? group_bytes : ahead;
}

// fn(std::integral_constant<int, L>) for the prefetch level L = level (0, 1, else 2).
template <class Fn>
static inline void with_level(int level, Fn&& fn) {
  if (level == 1)
    fn(std::integral_constant<int, 1>{});
  else if (level == 0)
    fn(std::integral_constant<int, 0>{});
  else
    fn(std::integral_constant<int, 2>{});
}

// Rows [r0, r1) of m for vectors v0 .. v0 + NV - 1: group(row, R, res) computes R rows from
// `row` (R an integral_constant: group_rows(NV), then 1 for the last few) into res[i * NV + v];
// the results go to out[(v0 + v) * ldo + (r - r0)].
template <int NV, class Group>
static inline void for_row_groups(const Mat& m, int64_t r0, int64_t r1, int v0, float* out,
                                  int64_t ldo, Group&& group) {
  constexpr int R = group_rows(NV);
  float res[R * NV];
  auto put = [&](int64_t r, int n) {
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < NV; ++v) out[(int64_t)(v0 + v) * ldo + (r + i - r0)] = res[i * NV + v];
  };
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    group(m.data + r * m.row_bytes, std::integral_constant<int, R>{}, res);
    put(r, R);
  }
  for (; r < r1; ++r) {
    group(m.data + r * m.row_bytes, std::integral_constant<int, 1>{}, res);
    put(r, 1);
  }
}

}  // namespace ft
