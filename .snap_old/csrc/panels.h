// Weight panels for the batched kernels (Panel in common.h): kPanelRows rows of a matrix in
// its checkpoint format decoded once into int8 tiles, then multiplied by every vector of a
// prompt. The decoding is the scalar reference's (decode_int): panels hold exact integers and
// scales, so every tier reads the same panel.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "dispatch.h"

namespace ft {

// Weights per sub-block of fmt's panels (one scale each), or 0 where there is no batched kernel.
int panel_sub(int fmt);

// A panel's storage, grown to the largest panel decoded into it.
struct PanelBuf {
  std::vector<int8_t> q;
  std::vector<float> scale, min;
  std::vector<int32_t> qsum;
};

// Rows [r0, r0 + rows) of m (cols wide, fmt), rows <= kPanelRows, into buf; the view in *p.
// decode_panel is the reference (through decode_int); the ISA tiers' PanelFn give its bytes.
using PanelFn = void (*)(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols,
                         PanelBuf& buf, Panel* p);
void decode_panel(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
                  Panel* p);
// The panel decoders of tier isa by format (null where it has none); the AVX2 tier fills its
// own (kernels_avx2.cpp), which the tiers above it use.
const PanelFn* panel_fns(int isa);
void register_panels_avx2(PanelFn* fns);
// The fastest panel decoder for fmt at or below `cap` (the reference where none is faster).
PanelFn pick_panel(int fmt, int cap);
// Sizes buf for a panel of fmt, cols wide (zeroed), and points *p at it.
void panel_view(int fmt, int rows, int64_t cols, PanelBuf& buf, Panel* p);
// Where dword j (weights 4j..4j+3) of 32-weight block b of panel row n goes in Panel::q, in
// dwords: the same for sub-blocks of 16 and 32.
static inline int64_t panel_dword(int64_t b, int j, int n) {
  return (8 * b + j) * kPanelRows + n;
}

// The activation values' sum over sub-block s (of `sub` values) of Q8 vector m, from its per-4
// sums: the batched kernels' min term.
static inline int32_t act_sum(const Act& a, int64_t m, int64_t s, int sub) {
  const int32_t* gs = a.gs + m * (a.K / 4) + s * sub / 4;
  int32_t t = 0;
  for (int j = 0; j < sub / 4; ++j) t += gs[j];
  return t;
}

}  // namespace ft
