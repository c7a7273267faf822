#include "dispatch.h"

#include <atomic>

namespace ft {
namespace {

std::atomic<int> g_prefetch{kDefaultPrefetch};
std::atomic<int> g_prefetch_level{kDefaultPrefetchLevel};

KernelTable build_table() {
  KernelTable t;
  std::memset(&t, 0, sizeof t);
  register_scalar(t);
#if FT_HAVE_X86
  register_avx2(t);
  register_avx512(t);
  register_avx512_vnni(t);
  register_avx512_bf16(t);
  register_amx(t);
#endif
  return t;
}

const KernelTable& table() {
  static const KernelTable t = build_table();
  return t;
}

int detect() {
#if FT_HAVE_X86
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return ISA_SCALAR;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
    return ISA_AVX2;
  if (!__builtin_cpu_supports("avx512vnni")) return ISA_AVX512;
  if (!__builtin_cpu_supports("avx512bf16")) return ISA_AVX512_VNNI;
  return ISA_AVX512_BF16;
#else
  return ISA_SCALAR;
#endif
}

}  // namespace

int prefetch_bytes() { return g_prefetch.load(std::memory_order_relaxed); }

int prefetch_level() { return g_prefetch_level.load(std::memory_order_relaxed); }

void set_prefetch(int bytes, int level) {
  g_prefetch.store(bytes < 0 ? 0 : bytes);
  g_prefetch_level.store(level < 0 ? 0 : level > 2 ? 2 : level);
}

int best_isa() {
  static const int isa = detect();
  return isa;
}

const char* isa_name(int isa) {
  static const char* names[ISA_COUNT] = {"scalar", "avx2", "avx512", "avx512_vnni",
                                         "avx512_bf16"};
  return isa >= 0 && isa < ISA_COUNT ? names[isa] : "unknown";
}

Pick pick_kernel(int fmt, int act, int cap) {
  if (fmt < 0 || fmt >= F_COUNT || act < 0 || act >= ACT_COUNT) return {nullptr, -1};
  if (cap > best_isa()) cap = best_isa();
  for (int isa = cap; isa >= 0; --isa)
    if (GemvFn fn = table().fn[fmt][act][isa]) return {fn, isa};
  return {nullptr, -1};
}

BatchPick pick_batch(int fmt, int cap) {
  if (fmt < 0 || fmt >= F_COUNT) return {nullptr, -1};
  if (cap > best_isa()) cap = best_isa();
  for (int isa = cap; isa >= 0; --isa)
    if (BatchFn fn = table().batch[fmt][isa]) return {fn, isa};
  return {nullptr, -1};
}

ReadFn pick_reader(int cap) {
  if (cap > best_isa()) cap = best_isa();
  for (int isa = cap; isa > 0; --isa)
    if (ReadFn fn = table().read[isa]) return fn;
  return table().read[ISA_SCALAR];
}

QuantFn pick_quantizer(int cap, int* picked) {
  if (cap > best_isa()) cap = best_isa();
  if (cap < ISA_SCALAR) cap = ISA_SCALAR;
  int isa = cap;
  while (isa > ISA_SCALAR && !table().quant[isa]) --isa;
  if (picked) *picked = isa;
  return table().quant[isa];
}

}  // namespace ft
