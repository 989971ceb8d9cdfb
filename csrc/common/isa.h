// The CPU kernels' ISA variants: which one runs (cpu_isa(), picked once by cpuid, forced with
// set_cpu_isa) and the ONE way a variant is compiled: function attributes FT_TARGET_AVX512 /
// FT_TARGET_AVX2 on the code of that variant, never -march or `#pragma GCC target` (the wheel runs
// on any x86-64). The variant without an attribute is the baseline x86-64 one.
//
// Kernels written with GCC vector extensions (common/vec.h) template their body on the lane count
// L and put the attribute on one entry point per ISA (always_inline pulls the body in); the top-k
// kernel, whose body uses intrinsics, puts it on every function of its body (topk/topk_kernel.h).
// A kernel picks its entry point per call from current_isa(), so set_cpu_isa reaches every kernel.
#pragma once

#include <string>

#define FT_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FT_HAS_ISA_VARIANTS 1
#define FT_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2")))
#define FT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#else
#define FT_HAS_ISA_VARIANTS 0
#define FT_TARGET_AVX512
#define FT_TARGET_AVX2
#endif

namespace freetoken {

enum class Isa { kAvx512, kAvx2, kBase };

// The variant in use (cpuid-checked).
Isa current_isa();
// Its name: "avx512", "avx2" or "base".
std::string cpu_isa();
// Forces "avx512", "avx2", "base" or "auto" (cpuid); raises (RuntimeError in Python) for a name
// this CPU or build cannot run, changing nothing.
void set_cpu_isa(const std::string& name);

}  // namespace freetoken
