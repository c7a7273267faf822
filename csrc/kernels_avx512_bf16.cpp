#include "common.h"
namespace ft {
void register_avx512_bf16(KernelTable&) {}
}  // namespace ft
