// Vectors of L lanes (GCC vector extensions) for the CPU kernels written once and compiled per
// ISA (common/isa.h): L = 16 on AVX-512, 8 on AVX2, 4 on baseline x86-64. Shared by the panel
// linears and paged attention, with the register transpose both use.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/isa.h"

namespace freetoken {
namespace vec {

template <int L>
struct Vec {
  typedef float f __attribute__((vector_size(4 * L)));
  typedef int32_t i __attribute__((vector_size(4 * L)));
  typedef uint32_t u __attribute__((vector_size(4 * L)));
  typedef uint16_t h __attribute__((vector_size(2 * L)));
};

template <int L>
FT_INLINE typename Vec<L>::f loadu(const float* p) {
  typename Vec<L>::f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int L>
FT_INLINE void storeu(float* p, typename Vec<L>::f v) {
  std::memcpy(p, &v, sizeof v);
}
template <int L>
FT_INLINE typename Vec<L>::f splat(float x) {
  return typename Vec<L>::f{} + x;
}

// NOTE: keeps a loaded vector in a register. Without it GCC folds the load into every FMA that
// uses it (MR loads of the same line instead of one): that halved the panel linear's L2-hot rate
// at M = 2 (38 -> 65 GB/s here).
template <typename T>
FT_INLINE T in_register(T v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
  return v;
}

// One stage of an L x L register transpose: in every pair of vectors (i, i + S), i without bit
// S, the lanes with bit S set in t[i] trade places with the lanes without it in t[i + S].
template <int L, int S>
FT_INLINE void transpose_stage(typename Vec<L>::f (&t)[L]) {
  using vi = typename Vec<L>::i;
  vi lo, hi;
#pragma GCC unroll 16
  for (int j = 0; j < L; ++j) {
    lo[j] = (j & S) ? L + j - S : j;
    hi[j] = (j & S) ? L + j : j + S;
  }
#pragma GCC unroll 16
  for (int i = 0; i < L; ++i) {
    if (i & S) continue;
    const auto a = t[i], b = t[i + S];
    t[i] = __builtin_shuffle(a, b, lo);
    t[i + S] = __builtin_shuffle(a, b, hi);
  }
  if constexpr (S > 1) transpose_stage<L, S / 2>(t);
}

// t[m][k] -> t[k][m] in registers (the stages S = L / 2 .. 1).
template <int L>
FT_INLINE void transpose(typename Vec<L>::f (&t)[L]) {
  transpose_stage<L, L / 2>(t);
}

}  // namespace vec
}  // namespace freetoken
