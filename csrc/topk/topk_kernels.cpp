// The dense kernel for avx512; the body is cpu_kernel_impl.h (see there).
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,popcnt")
#define FT_ISA_NS isa_avx512
#define FT_ISA_NAME "avx512"
#define FT_ISA_LEVEL 2
#include "cpu_kernel_impl.h"
#pragma GCC pop_options
#else
// Other compilers / architectures: this ISA is absent and never chosen.
namespace freetoken {
namespace isa_avx512 {
IsaKernels kernels() { return IsaKernels{"avx512", nullptr, nullptr}; }
bool compiled() { return false; }
}  // namespace isa_avx512
}  // namespace freetoken
#endif
