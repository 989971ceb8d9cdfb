// Per-ISA target attributes for the CPU kernels compiled several times in one file (no -march:
// the wheel runs on any x86-64; the variant is chosen at run time by freetoken::cpu_isa()).
#pragma once

#define FT_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FT_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2")))
#define FT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#else
#define FT_TARGET_AVX512
#define FT_TARGET_AVX2
#endif
