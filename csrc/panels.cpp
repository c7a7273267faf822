#include "panels.h"

#include <cstring>

namespace ft {

int panel_sub(int fmt) {
  switch (fmt) {
    case F_Q8_0: case F_Q4_0: case F_Q5_0: case F_MXFP4: case F_Q4_K: return 32;
    case F_Q6_K: return 16;
    default: return 0;
  }
}

void decode_panel(int fmt, const Mat& m, int64_t r0, int rows, int64_t cols, PanelBuf& buf,
                  Panel* p) {
  const int sub = panel_sub(fmt);
  const int unit = FMT_INFO[fmt].block;
  const int64_t nsub = cols / sub, per_unit = unit / sub;
  const bool mins = fmt == F_Q4_K;
  buf.q.assign((size_t)(cols * kPanelRows), 0);
  buf.scale.assign((size_t)(nsub * kPanelRows), 0.0f);
  buf.min.assign(mins ? (size_t)(nsub * kPanelRows) : 0, 0.0f);
  buf.qsum.assign((size_t)(nsub * kPanelRows), 0);
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
  p->sub = sub;
  p->nsub = nsub;
  p->rows = rows;
  p->q = buf.q.data();
  p->scale = buf.scale.data();
  p->min = mins ? buf.min.data() : nullptr;
  p->qsum = buf.qsum.data();
}

}  // namespace ft
