// Runtime ISA detection and kernel selection: the best implementation at or below a tier cap,
// falling back tier by tier to the scalar reference.
#pragma once

#include "common.h"

namespace ft {

// The highest tier this CPU (and OS) supports.
int best_isa();
const char* isa_name(int isa);

struct Pick {
  GemvFn fn;
  int isa;  // the tier whose implementation was picked
};

// The best kernel for (fmt, act) at or below `cap`; fn is null when none exists.
Pick pick_kernel(int fmt, int act, int cap);

struct BatchPick {
  BatchFn fn;
  int isa;
};

// The best batched kernel for fmt's panels at or below `cap` (Q8 activations); fn is null
// when none exists. At the top tier it is AMX's where the CPU has it.
BatchPick pick_batch(int fmt, int cap);

// The widest memory reader at or below `cap`.
ReadFn pick_reader(int cap);

// The fastest Q8 activation quantiser at or below `cap` (its tier in *isa if given).
QuantFn pick_quantizer(int cap, int* isa = nullptr);

}  // namespace ft
