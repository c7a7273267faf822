#include "common.h"
namespace ft {
void register_avx512(KernelTable&) {}
}  // namespace ft
