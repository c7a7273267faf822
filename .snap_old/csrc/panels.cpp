#include "panels.h"

#include <cstring>

namespace ft {

int panel_sub(int fmt) {
  switch (fmt) {
    case F_Q8_0: case F_Q4_0: case F_Q5_0: case F_MXFP4: case F_Q4_K: case F_Q5_K: return 32;
    case F_Q6_K: return 16;
    default: return 0;
  }
}

void panel_view(int fmt, int rows, int64_t cols, PanelBuf& buf, Panel* p) {
  const int sub = panel_sub(fmt);
  const int64_t nsub = cols / sub;
  const bool mins = fmt == F_Q4_K || fmt == F_Q5_K;
  buf.q.assign((size_t)(cols * kPanelRows), 0);
  buf.scale.assign((size_t)(nsub * kPanelRows), 0.0f);
  buf.min.assign(mins ? (size_t)(nsub * kPanelRows) : 0, 0.0f);
  buf.qsum.assign((size_t)(nsub * kPanelRows), 0);
  p->sub = sub;
  p->nsub = nsub;
  p->rows = rows;
  p->q = buf.q.data();
  p->scale = buf.scale.data();
  p->min = mins ? buf.min.data() : nullptr;
  p->qsum = buf.qsum.data();
}

const PanelFn* panel_fns(int isa) {
  struct Table {
    PanelFn fn[ISA_COUNT][F_COUNT] = {};
    Table() {
#if FT_HAVE_X86
      register_panels_avx2(fn[ISA_AVX2]);
#endif
    }
  };
  static const Table t;
  return t.fn[isa];
}

PanelFn pick_panel(int fmt, int cap) {
  if (cap > best_isa()) cap = best_isa();
  if (fmt >= 0 && fmt < F_COUNT)
    for (int isa = cap; isa > ISA_SCALAR; --isa)
      if (PanelFn fn = panel_fns(isa)[fmt]) return fn;
  return decode_panel;
}

void decode_panel(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
                  Panel* p) {
  panel_view(fmt, rows, cols, buf, p);
  const int sub = p->sub;
  const int unit = FMT_INFO[fmt].block;
  const int64_t per_unit = unit / sub;
  const bool mins = p->min != nullptr;
  int16_t q[256];
  float s[16], mn[16];
  for (int n = 0; n < rows; ++n) {
    for (int64_t u = 0; u < cols / unit; ++u) {
      decode_int(fmt, m, r0 + n, u, q, s, mn);
      for (int64_t j = 0; j < per_unit; ++j) {
        const int64_t sb = u * per_unit + j;
        const int16_t* qs = q + j * sub;
        int32_t sum = 0;
        for (int k = 0; k < sub; ++k) {
          buf.q[(size_t)(((sb * sub / 4 + k / 4) * kPanelRows + n) * 4 + k % 4)] = (int8_t)qs[k];
          sum += qs[k];
        }
        buf.qsum[sb * kPanelRows + n] = sum;
        buf.scale[sb * kPanelRows + n] = s[j * sub / 16];
        if (mins) buf.min[sb * kPanelRows + n] = mn[j * sub / 16];
      }
    }
  }
}

}  // namespace ft
