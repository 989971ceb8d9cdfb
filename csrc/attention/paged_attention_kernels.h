// The micro-kernels of csrc/attention/paged_attention_cpu.cpp: vectors of L floats (GCC vector
// extensions), the exp of the softmax, the two register-blocked products of a key tile
// (S^T = K Q^T and O += P V), decode's S^T by vectors of keys (qk_keys: the same sums), the
// prefetch of the rows and, per ISA, their loops as out-of-line functions.
// Included by paged_attention_cpu.cpp only; everything inlines into the ISA-targeted callers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/isa.h"
#include "common/vec.h"

namespace freetoken {
namespace paged_attention_kernels {

using vec::in_register;
using vec::loadu;
using vec::splat;
using vec::storeu;
using vec::Vec;

// exp(x) for x <= 0 or -inf, L lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (< 2e-7 relative), times 2^n from the exponent bits; n is rounded with the
// 1.5 * 2^23 trick (SSE2 has no round instruction). Exactly 0 below -87.3 (masked keys too).
template <int L>
FT_INLINE typename Vec<L>::f exp_nonpositive(typename Vec<L>::f x) {
  using vf = typename Vec<L>::f;
  using vi = typename Vec<L>::i;
  const vf lo = splat<L>(-87.3f);
  const vi dead = x < lo;
  const vf xc = dead ? lo : x;
  const vf magic = splat<L>(12582912.f);
  const vf n = (xc * 1.44269504089f + magic) - magic;
  const vf r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  vf p = splat<L>(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return dead ? vf{} : p * two_n;
}

// ---------------------------------------------------------------------------------------------
// The two micro-kernels. cw: S^T's row stride (the padded column count).

// S^T[m, j*L ..] = sum_d K[m, d] Q^T[d, j*L ..] for MR keys and NP vectors of columns.
template <int L, int MR, int NP>
FT_INLINE void qk_block(const float* const* krow, const float* qt, int64_t cw, int64_t hd,
                        float* s) {
  using vf = typename Vec<L>::f;
  const float* k[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) k[m] = krow[m];
  vf acc[MR][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[m][j] = vf{};
  for (int64_t d = 0; d < hd; ++d) {
    vf qv[NP];
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) qv[j] = in_register(loadu<L>(qt + d * cw + j * L));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float kb = k[m][d];
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) acc[m][j] += qv[j] * kb;
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) storeu<L>(s + m * cw + j * L, acc[m][j]);
}

// mr (1..MR) keys, np (1..NP) column vectors: one instantiation per pair.
template <int L, int MR, int NP>
FT_INLINE void qk_any(int mr, int np, const float* const* krow, const float* qt, int64_t cw,
                      int64_t hd, float* s) {
  if constexpr (MR > 1) {
    if (mr < MR) return qk_any<L, MR - 1, NP>(mr, np, krow, qt, cw, hd, s);
  }
  if constexpr (NP > 1) {
    if (np < NP) return qk_any<L, MR, NP - 1>(mr, np, krow, qt, cw, hd, s);
  }
  qk_block<L, MR, NP>(krow, qt, cw, hd, s);
}

// O[c, voff + v*L ..] = alpha[c] O[c, ..] + sum_p P[p, c] V[p, voff + v*L ..] for MC columns
// and VC vectors of the head dimension; o's row stride is hd. P[p, c] is p[p * ps + c], or
// with kColMajor (decode's probabilities, keys along a column) p[c * ps + p]. Either way each
// output is one chain over p (the same bits).
template <int L, int MC, int VC, bool kColMajor>
FT_INLINE void pv_block(const float* const* vrow, int64_t n, int64_t voff, const float* p,
                        int64_t ps, const float* alpha, float* o, int64_t hd) {
  using vf = typename Vec<L>::f;
  vf acc[MC][VC];
#pragma GCC unroll 16
  for (int m = 0; m < MC; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) acc[m][v] = loadu<L>(o + m * hd + voff + v * L) * alpha[m];
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = vrow[j] + voff;
    vf vv[VC];
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) vv[v] = in_register(loadu<L>(vr + v * L));
#pragma GCC unroll 16
    for (int m = 0; m < MC; ++m) {
      const float pb = kColMajor ? p[m * ps + j] : p[j * ps + m];
#pragma GCC unroll 16
      for (int v = 0; v < VC; ++v) acc[m][v] += vv[v] * pb;
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MC; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) storeu<L>(o + m * hd + voff + v * L, acc[m][v]);
}

template <int L, int MC, int VC, bool kColMajor>
FT_INLINE void pv_any(int mc, int vc, const float* const* vrow, int64_t n, int64_t voff,
                      const float* p, int64_t ps, const float* alpha, float* o, int64_t hd) {
  if constexpr (MC > 1) {
    if (mc < MC)
      return pv_any<L, MC - 1, VC, kColMajor>(mc, vc, vrow, n, voff, p, ps, alpha, o, hd);
  }
  if constexpr (VC > 1) {
    if (vc < VC)
      return pv_any<L, MC, VC - 1, kColMajor>(mc, vc, vrow, n, voff, p, ps, alpha, o, hd);
  }
  pv_block<L, MC, VC, kColMajor>(vrow, n, voff, p, ps, alpha, o, hd);
}

// A task's scratch, sized by the caller (std:: code stays out of the ISA bodies).
struct Scratch {
  float* qt;     // [hd, cw]
  float* s;      // [kKeyTile, cw]
  float* o;      // [cols, hd]
  float* m;      // [cw] running max
  float* l;      // [cw] running sum
  float* alpha;  // [cw] this tile's rescale of O
  const float** krow;  // [kKeyTile]
  const float** vrow;
  float* kw;  // [kKeyTile, hd] widened K / V rows (non-fp32 pools)
  float* vw;
};

// Register blocks. QK: MR keys x NP vectors of LC columns; PV: MC columns x VC vectors of L
// floats of the head dimension. AVX-512 has 32 vector registers, AVX2 and SSE2 16.
template <int LC, int MR, int NP>
struct QkShape {
  static constexpr int kLC = LC, kMR = MR, kNP = NP;
};
template <int L, int MC, int VC>
struct PvShape {
  static constexpr int kL = L, kMC = MC, kVC = VC;
};

// Keys whose K and V rows are requested ahead of the QK product reaching them.
constexpr int64_t kPrefetchKeys = 32;

// Asks for the K and V rows of keys [a, b) into L2 (K is read next, V after the softmax).
// NOTE: a head's rows in the pool are hd-float runs at the stride of all kv heads, in blocks
// scattered over the pool, which the hardware prefetchers do not follow: a decode task (every
// key read once) waited on DRAM for ~3/4 of its time. Into L1 (prefetcht0) the requests held
// the L1's few miss buffers and helped ~10-25%; into L2 (prefetcht1), kPrefetchKeys = 16..64,
// one thread at context 201 ran 290-370 -> 200-240 us per layer, two threads 180 -> 120-140.
FT_INLINE void prefetch_rows(const Scratch& w, int64_t a, int64_t b, int64_t hd) {
  for (int64_t j = a; j < b; ++j) {
    const uintptr_t k = reinterpret_cast<uintptr_t>(w.krow[j]);
    const uintptr_t v = reinterpret_cast<uintptr_t>(w.vrow[j]);
    for (uintptr_t off = 0; off < static_cast<uintptr_t>(hd) * 4 + (k & 63); off += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>((k & ~uintptr_t{63}) + off), 0, 2);
      __builtin_prefetch(reinterpret_cast<const void*>((v & ~uintptr_t{63}) + off), 0, 2);
    }
  }
}

// S^T[j, c0 ..] for keys [0, n) and vectors [v0, v1) of QK::kLC columns starting at column c0.
// The first pass over the keys requests the rows kPrefetchKeys ahead.
template <class QK>
FT_INLINE void qk_range(const Scratch& w, int64_t n, int64_t c0, int64_t nvec, int64_t cw,
                        int64_t hd) {
  constexpr int LC = QK::kLC;
  for (int64_t v0 = 0; v0 < nvec; v0 += QK::kNP) {
    const int np = static_cast<int>(std::min<int64_t>(QK::kNP, nvec - v0));
    const int64_t col = c0 + v0 * LC;
    for (int64_t j = 0; j < n; j += QK::kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(QK::kMR, n - j));
      if (v0 == 0 && j + kPrefetchKeys < n)
        prefetch_rows(w, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + mr), hd);
      qk_any<LC, QK::kMR, QK::kNP>(mr, np, w.krow + j, w.qt + col, cw, hd, w.s + j * cw + col);
    }
  }
}

// One query token (decode): S[c, j] (row stride ss) for keys [0, n) (n a multiple of L) and NC
// columns, by vectors of L keys. L key rows are transposed in registers, L head dimensions at a
// time, so each score is still the one FMA chain over d that qk_block computes (the same bits:
// batch invariance) with every lane in use, where qk_block's column vectors would hold NC (3 at
// G = 3) of their L lanes. q is Q^T [hd, cw] as run_task packs it. Rows kPrefetchKeys ahead.
template <int L, int NC>
FT_INLINE void qk_keys_cols(const Scratch& w, int64_t n, int64_t cw, int64_t hd, int64_t ss) {
  using vf = typename Vec<L>::f;
  for (int64_t j0 = 0; j0 < n; j0 += L) {
    const int64_t nk = std::min<int64_t>(L, n - j0);
    if (j0 + kPrefetchKeys < n)
      prefetch_rows(w, j0 + kPrefetchKeys, std::min(n, j0 + kPrefetchKeys + L), hd);
    const float* k[L];
#pragma GCC unroll 16
    for (int i = 0; i < L; ++i) k[i] = w.krow[j0 + std::min<int64_t>(i, nk - 1)];
    vf acc[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = vf{};
    int64_t d0 = 0;
    for (; d0 + L <= hd; d0 += L) {
      vf t[L];
#pragma GCC unroll 16
      for (int i = 0; i < L; ++i) t[i] = loadu<L>(k[i] + d0);
      vec::transpose<L>(t);  // t[dd]: dimension d0 + dd of the L keys
#pragma GCC unroll 16
      for (int dd = 0; dd < L; ++dd)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) acc[c] += t[dd] * w.qt[(d0 + dd) * cw + c];
    }
    for (; d0 < hd; ++d0) {  // a head_dim tail
      vf kv;
#pragma GCC unroll 16
      for (int i = 0; i < L; ++i) kv[i] = k[i][d0];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[c] += kv * w.qt[d0 * cw + c];
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) storeu<L>(w.s + c * ss + j0, acc[c]);
  }
}

template <int L>
FT_INLINE void qk_keys(const Scratch& w, int64_t n, int64_t nc, int64_t cw, int64_t hd,
                       int64_t ss) {
  switch (nc) {
    case 1: return qk_keys_cols<L, 1>(w, n, cw, hd, ss);
    case 2: return qk_keys_cols<L, 2>(w, n, cw, hd, ss);
    case 3: return qk_keys_cols<L, 3>(w, n, cw, hd, ss);
    case 4: return qk_keys_cols<L, 4>(w, n, cw, hd, ss);
    case 5: return qk_keys_cols<L, 5>(w, n, cw, hd, ss);
    case 6: return qk_keys_cols<L, 6>(w, n, cw, hd, ss);
    case 7: return qk_keys_cols<L, 7>(w, n, cw, hd, ss);
    default: return qk_keys_cols<L, 8>(w, n, cw, hd, ss);
  }
}

// The softmax's sum over a tile's keys, in one order for both walks: key j goes into partial
// sum j % kSumParts (each summed in key order), and the parts meet in a fixed tree. run_task
// keeps the parts in vectors across columns, run_decode in the lanes of vectors across keys.
constexpr int kSumParts = 8;
template <typename T>
FT_INLINE T sum_parts(const T (&p)[kSumParts]) {
  const T a = p[0] + p[4], b = p[1] + p[5], c = p[2] + p[6], d = p[3] + p[7];
  return (a + c) + (b + d);
}

// O = alpha O + P V over columns [0, nc) (PV::kMC at a time), each group only over the keys
// its last column can see: keys_seen(c) = min(n, keys visible to column c); a head_dim tail
// (hd % L) in scalar code. P as in pv_block, at stride ps.
template <class PV, bool kColMajor>
FT_INLINE void pv_range(const Scratch& w, int64_t n, int64_t nc, int64_t ps, int64_t hd,
                        int64_t seen0, int64_t col0, int64_t G) {
  constexpr int L = PV::kL;
  const int64_t full = hd / L;
  for (int64_t c = 0; c < nc; c += PV::kMC) {
    const int mc = static_cast<int>(std::min<int64_t>(PV::kMC, nc - c));
    const int64_t keys = std::min(n, seen0 + (col0 + c + mc - 1) / G);
    for (int64_t v = 0; v < full; v += PV::kVC) {
      const int vc = static_cast<int>(std::min<int64_t>(PV::kVC, full - v));
      pv_any<L, PV::kMC, PV::kVC, kColMajor>(mc, vc, w.vrow, keys, v * L,
                                             w.s + (kColMajor ? c * ps : c), ps, w.alpha + c,
                                             w.o + c * hd, hd);
    }
    for (int64_t d = full * L; d < hd; ++d)
      for (int m = 0; m < mc; ++m) {
        float acc = w.o[(c + m) * hd + d] * w.alpha[c + m];
        for (int64_t j = 0; j < keys; ++j)
          acc += w.s[kColMajor ? (c + m) * ps + j : j * ps + c + m] * w.vrow[j][d];
        w.o[(c + m) * hd + d] = acc;
      }
  }
}

// One ISA's micro-kernel loops as out-of-line functions: inlined into run_task, GCC ran out of
// registers and kept the key pointers on the stack (the narrow shapes ran ~2x slower).
// QK: the column vectors; QKT: a narrower shape for a last vector that is at most QKT::kLC
// full (the narrower FMAs cost half on Zen 4 / Intel's 2 x 256-bit units), or QK itself.
template <class QK_, class QKT_, class PV_>
struct Shapes {
  using QK = QK_;
  using QKT = QKT_;
  using PV = PV_;
  static constexpr int kL = PV::kL, kLC = QK::kLC, kNP = QK::kNP, kTailLC = QKT::kLC;
};
#define FT_ATTENTION_KERNELS(NAME, TARGET, ...)                                                   \
  struct NAME : __VA_ARGS__ {                                                                     \
    TARGET __attribute__((noinline)) static void qk(const Scratch& w, int64_t n, int64_t c0,      \
                                                    int64_t nvec, int64_t cw, int64_t hd) {       \
      qk_range<typename NAME::QK>(w, n, c0, nvec, cw, hd);                                        \
    }                                                                                             \
    TARGET __attribute__((noinline)) static void qk_tail(const Scratch& w, int64_t n,             \
                                                         int64_t c0, int64_t cw, int64_t hd) {    \
      qk_range<typename NAME::QKT>(w, n, c0, 1, cw, hd);                                          \
    }                                                                                             \
    TARGET __attribute__((noinline)) static void pv(const Scratch& w, int64_t n, int64_t nc,      \
                                                    int64_t cw, int64_t hd, int64_t seen0,        \
                                                    int64_t col0, int64_t G) {                    \
      pv_range<typename NAME::PV, false>(w, n, nc, cw, hd, seen0, col0, G);                       \
    }                                                                                             \
    TARGET __attribute__((noinline)) static void qk_one_token(const Scratch& w, int64_t n,        \
                                                              int64_t nc, int64_t cw, int64_t hd, \
                                                              int64_t ss) {                       \
      qk_keys<NAME::kL>(w, n, nc, cw, hd, ss);                                                    \
    }                                                                                             \
    TARGET __attribute__((noinline)) static void pv_cols(const Scratch& w, int64_t n, int64_t nc, \
                                                         int64_t ss, int64_t hd) {                \
      pv_range<typename NAME::PV, true>(w, n, nc, ss, hd, n, 0, 1);                               \
    }                                                                                             \
  };

// Per ISA: 16 columns per vector for wide tasks, 8 for tasks of at most 8 columns (decode:
// one token x G heads). AVX-512 has 32 vector registers, AVX2 and SSE2 16. The wide QK takes
// up to 6 column vectors by 4 keys: a classify task's 84 columns (28 tokens x 3 heads) are 5
// full vectors, one group, where 6 keys x 4 vectors left a group of one vector whose 6 FMAs
// waited on 7 loads (QK cycles of that call -7 % on a Sapphire-Rapids-class Xeon).
FT_ATTENTION_KERNELS(Avx512Wide, FT_TARGET_AVX512,
                     Shapes<QkShape<16, 4, 6>, QkShape<8, 6, 1>, PvShape<16, 6, 4>>)
FT_ATTENTION_KERNELS(Avx512Narrow, FT_TARGET_AVX512,
                     Shapes<QkShape<8, 6, 2>, QkShape<4, 6, 1>, PvShape<16, 6, 4>>)
FT_ATTENTION_KERNELS(Avx2Kernels, FT_TARGET_AVX2,
                     Shapes<QkShape<8, 3, 3>, QkShape<4, 3, 3>, PvShape<8, 3, 3>>)
FT_ATTENTION_KERNELS(BaseKernels, , Shapes<QkShape<4, 3, 3>, QkShape<4, 3, 3>, PvShape<4, 3, 3>>)
#undef FT_ATTENTION_KERNELS

}  // namespace paged_attention_kernels
}  // namespace freetoken
