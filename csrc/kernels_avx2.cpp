#include "common.h"
namespace ft {
void register_avx2(KernelTable&) {}
}  // namespace ft
