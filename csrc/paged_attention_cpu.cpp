// Paged attention on the CPU for any number of query tokens per sequence (decode, prefill, a
// prompt behind a cached prefix, chunks): K/V read in place from the paged pool, causal, GQA, an
// optional sliding window.
//
// Why: the torch path (freetoken/model/attention.py) gathers every multi-token sequence's context
// into a dense copy per layer and runs one padded SDPA with an additive mask; on the classify step
// (8 x 28 queries behind 176 cached keys, SmolLM2) that was ~1.6 ms per layer at ~60 GFLOP/s. This
// kernel does the same work as two register-blocked GEMMs per task with no copy of fp32 K/V.
//
// Tasks: (sequence, kv head, a tile of up to ~96 query columns); a column is one (query token,
// head of that kv head's group), so the G = nh / kvh heads sharing K/V share each K/V read. Per
// task, keys are walked in tiles of kKeyTile (online softmax: scratch is bounded by the tiles,
// not the context), and per key tile:
//   S^T [keys, cols] = K Q^T: Q^T packed once per task into [hd, cols] (cols padded to the vector
//     width), each K[p, d] broadcast from its row in the pool, MR keys x NP vectors of columns of
//     accumulators (as the panel linear in linear_cpu.cpp);
//   the causal / window mask, then the softmax update down each column, vectorized across
//     columns (running max and sum per column, the output rescaled when the max grows);
//   O [cols, hd] += P V: each V row read in place as hd / L vectors, P's entries broadcast.
//
// Numerics: fp32 scores, softmax and sums (as SDPA on CPU); q pre-scaled; exp by a polynomial
// (error < 2e-7 relative; std::exp does not vectorize without -ffast-math). bf16 / fp16 pools
// are widened exactly into a per-tile fp32 copy. The result is fp32 (the caller casts).
//
// ISA: one body compiled for AVX-512, AVX2+FMA and baseline x86-64 through target attributes,
// chosen per call by freetoken::cpu_isa() (FREETOKEN_CPU_ISA / set_cpu_isa), like
// linear_cpu.cpp; no -march. Threads: csrc/task_pool.h (at::parallel_for is serial here); a call
// estimated to be short stays on the caller.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_target.h"
#include "paged_attention_cpu.h"
#include "ops_torch.h"
#include "task_pool.h"

namespace freetoken {
namespace {

constexpr int64_t kKeyTile = 256;  // keys per softmax step: S^T tile <= 256 x 96 fp32 (L2)
constexpr int64_t kColTile = 96;   // the most query columns per task (a multiple of 16)
// NOTE: waking a helper costs ~10-40 us here; a call estimated under this on one thread runs on
// the caller alone.
constexpr double kInlineNs = 60e3;

template <int L>
struct Vec {
  typedef float f __attribute__((vector_size(4 * L)));
  typedef int32_t i __attribute__((vector_size(4 * L)));
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

// Keeps a loaded vector in a register (GCC otherwise folds the load into every FMA using it).
template <typename T>
FT_INLINE T in_register(T v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
  return v;
}

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
// and VC vectors of the head dimension; o's row stride is hd.
template <int L, int MC, int VC>
FT_INLINE void pv_block(const float* const* vrow, int64_t n, int64_t voff, const float* p,
                        int64_t cw, const float* alpha, float* o, int64_t hd) {
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
      const float pb = p[j * cw + m];
#pragma GCC unroll 16
      for (int v = 0; v < VC; ++v) acc[m][v] += vv[v] * pb;
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MC; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) storeu<L>(o + m * hd + voff + v * L, acc[m][v]);
}

template <int L, int MC, int VC>
FT_INLINE void pv_any(int mc, int vc, const float* const* vrow, int64_t n, int64_t voff,
                      const float* p, int64_t cw, const float* alpha, float* o, int64_t hd) {
  if constexpr (MC > 1) {
    if (mc < MC) return pv_any<L, MC - 1, VC>(mc, vc, vrow, n, voff, p, cw, alpha, o, hd);
  }
  if constexpr (VC > 1) {
    if (vc < VC) return pv_any<L, MC, VC - 1>(mc, vc, vrow, n, voff, p, cw, alpha, o, hd);
  }
  pv_block<L, MC, VC>(vrow, n, voff, p, cw, alpha, o, hd);
}

// ---------------------------------------------------------------------------------------------
// One task

struct Problem {
  const float* q;  // [T, nh, hd] fp32, head stride hd, row stride q_row
  int64_t q_row;
  const void* k_pool;  // [NB, bs, kvh, hd] of CacheT, contiguous
  const void* v_pool;
  const int64_t* block_tables;  // [S, max_blocks]
  int64_t max_blocks;
  const int64_t* seq_lens;  // [S]
  const int64_t* qsl;       // [S + 1]
  float* out;               // [T, nh, hd] fp32 contiguous
  int64_t nh, kvh, hd, bs, group;
  float scale;
  int64_t window;  // <= 0: none
};

struct Task {
  int64_t seq, kv_head, col0, col1;  // columns c = token * group + head-in-group
  double cost;                       // multiply-adds, for ordering and the inline decision
};

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

FT_INLINE void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
FT_INLINE void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(b[i]) << 16;  // exact
    std::memcpy(dst + i, &u, 4);
  }
}
FT_INLINE void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

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

// S^T[j, c0 ..] for keys [0, n) and vectors [v0, v1) of QK::kLC columns starting at column c0.
template <class QK>
FT_INLINE void qk_range(const Scratch& w, int64_t n, int64_t c0, int64_t nvec, int64_t cw,
                        int64_t hd) {
  constexpr int LC = QK::kLC;
  for (int64_t v0 = 0; v0 < nvec; v0 += QK::kNP) {
    const int np = static_cast<int>(std::min<int64_t>(QK::kNP, nvec - v0));
    const int64_t col = c0 + v0 * LC;
    for (int64_t j = 0; j < n; j += QK::kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(QK::kMR, n - j));
      qk_any<LC, QK::kMR, QK::kNP>(mr, np, w.krow + j, w.qt + col, cw, hd, w.s + j * cw + col);
    }
  }
}

// One task. QK: the column vectors; QKT: a half-width shape for a last vector that is at most
// half full (the narrower FMAs cost half on Zen 4 / Intel's 2 x 256-bit units), or QK itself.
template <class PV, class QK, class QKT, typename CacheT>
FT_INLINE void run_task(const Problem& pr, const Task& t, const Scratch& w) {
  constexpr int L = PV::kL, LC = QK::kLC;
  using vf = typename Vec<LC>::f;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t hd = pr.hd, G = pr.group, s = t.seq;
  const int64_t nc = t.col1 - t.col0, nv = (nc + LC - 1) / LC, cw = nv * LC;
  const int64_t seq_len = pr.seq_lens[s], q0 = pr.qsl[s];
  const int64_t first_pos = seq_len - (pr.qsl[s + 1] - q0);
  const int64_t row_len = pr.kvh * hd;
  const int64_t* blocks = pr.block_tables + s * pr.max_blocks;
  // Columns are in token order, so column c's query position is non-decreasing in c.
  const auto pos_of = [&](int64_t c) { return first_pos + (t.col0 + c) / G; };

  // Q^T [hd, cw], scaled; padding columns repeat the last real one (their lanes are unused).
  for (int64_t c = 0; c < cw; ++c) {
    const int64_t gc = t.col0 + std::min(c, nc - 1);
    const float* qr = pr.q + (q0 + gc / G) * pr.q_row + (t.kv_head * G + gc % G) * hd;
    for (int64_t d = 0; d < hd; ++d) w.qt[d * cw + c] = qr[d] * pr.scale;
  }
  for (int64_t c = 0; c < cw; ++c) {
    w.m[c] = kNegInf;
    w.l[c] = 0.f;
  }
  std::memset(w.o, 0, sizeof(float) * nc * hd);
  const int64_t key_lo = pr.window > 0 ? std::max<int64_t>(0, pos_of(0) - pr.window + 1) : 0;
  const int64_t key_hi = pos_of(nc - 1) + 1;
  // A half-full last vector goes through QKT.
  const int64_t tail_real = nc - (nv - 1) * LC;
  const bool narrow_tail = QKT::kLC < LC && tail_real <= QKT::kLC;

  for (int64_t k0 = key_lo; k0 < key_hi; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, key_hi - k0);
    // Row pointers, block by block (no division per key).
    for (int64_t j = 0, p = k0; j < n;) {
      const int64_t off = p % pr.bs, run = std::min(pr.bs - off, n - j);
      const int64_t base = (blocks[p / pr.bs] * pr.bs + off) * row_len + t.kv_head * hd;
      const CacheT* kr = static_cast<const CacheT*>(pr.k_pool) + base;
      const CacheT* vr = static_cast<const CacheT*>(pr.v_pool) + base;
      for (int64_t r = 0; r < run; ++r, ++j, kr += row_len, vr += row_len) {
        if constexpr (std::is_same_v<CacheT, float>) {
          w.krow[j] = kr;
          w.vrow[j] = vr;
        } else {
          widen(kr, w.kw + j * hd, hd);
          widen(vr, w.vw + j * hd, hd);
          w.krow[j] = w.kw + j * hd;
          w.vrow[j] = w.vw + j * hd;
        }
      }
      p += run;
    }
    // S^T = K Q^T, per group of column vectors only over the keys some column in it can see
    // (the mask below hides the rest).
    const int64_t full_vecs = narrow_tail ? nv - 1 : nv;
    for (int64_t v0 = 0; v0 < full_vecs; v0 += QK::kNP) {
      const int64_t v1 = std::min(full_vecs, v0 + QK::kNP);
      const int64_t last = std::min(nc - 1, v1 * LC - 1);
      const int64_t keys = std::min(n, pos_of(last) + 1 - k0);
      qk_range<QK>(w, keys, v0 * LC, v1 - v0, cw, hd);
    }
    if (narrow_tail) qk_range<QKT>(w, n, (nv - 1) * LC, 1, cw, hd);
    // The mask: row p hides the columns before the first token at position >= p (causal) and,
    // with a window, the columns from the first token at position >= p + window.
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = k0 + j;
      const int64_t causal = std::clamp<int64_t>((p - first_pos) * G - t.col0, 0, nc);
      const int64_t win_end =
          pr.window > 0 ? std::clamp<int64_t>((p + pr.window - first_pos) * G - t.col0, 0, nc)
                        : nc;
      float* row = w.s + j * cw;
      for (int64_t c = 0; c < causal; ++c) row[c] = kNegInf;
      for (int64_t c = win_end; c < nc; ++c) row[c] = kNegInf;
    }
    // Softmax update down each column: new max, P = exp(S - max) in place, rescale of O.
    for (int64_t v = 0; v < nv; ++v) {
      const vf m_old = loadu<LC>(w.m + v * LC);
      vf mx[4] = {m_old, m_old, m_old, m_old};  // 4 chains: vmaxps latency
      int64_t j = 0;
      for (; j + 4 <= n; j += 4)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const vf x = loadu<LC>(w.s + (j + u) * cw + v * LC);
          mx[u] = x > mx[u] ? x : mx[u];
        }
      for (; j < n; ++j) {
        const vf x = loadu<LC>(w.s + j * cw + v * LC);
        mx[0] = x > mx[0] ? x : mx[0];
      }
      mx[0] = mx[1] > mx[0] ? mx[1] : mx[0];
      mx[2] = mx[3] > mx[2] ? mx[3] : mx[2];
      const vf m_new = mx[2] > mx[0] ? mx[2] : mx[0];
      // A column that has seen no key yet keeps max -inf; shift by 0 so exp gives 0, not NaN.
      const vf shift = m_new == splat<LC>(kNegInf) ? vf{} : m_new;
      vf sum = vf{};
      for (j = 0; j < n; ++j) {
        float* row = w.s + j * cw + v * LC;
        const vf e = exp_nonpositive<LC>(loadu<LC>(row) - shift);
        storeu<LC>(row, e);
        sum += e;
      }
      const vf a = exp_nonpositive<LC>(m_old - shift);
      storeu<LC>(w.alpha + v * LC, a);
      storeu<LC>(w.l + v * LC, loadu<LC>(w.l + v * LC) * a + sum);
      storeu<LC>(w.m + v * LC, m_new);
    }
    // O = alpha O + P V over the real columns, each group only over the keys it can see; a
    // head_dim tail (hd % L) in scalar code.
    const int64_t full = hd / L;
    for (int64_t c = 0; c < nc; c += PV::kMC) {
      const int mc = static_cast<int>(std::min<int64_t>(PV::kMC, nc - c));
      const int64_t keys = std::min(n, pos_of(c + mc - 1) + 1 - k0);
      for (int64_t v = 0; v < full; v += PV::kVC) {
        const int vc = static_cast<int>(std::min<int64_t>(PV::kVC, full - v));
        pv_any<L, PV::kMC, PV::kVC>(mc, vc, w.vrow, keys, v * L, w.s + c, cw, w.alpha + c,
                                    w.o + c * hd, hd);
      }
      for (int64_t d = full * L; d < hd; ++d)
        for (int m = 0; m < mc; ++m) {
          float acc = w.o[(c + m) * hd + d] * w.alpha[c + m];
          for (int64_t j = 0; j < keys; ++j) acc += w.s[j * cw + c + m] * w.vrow[j][d];
          w.o[(c + m) * hd + d] = acc;
        }
    }
  }
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t gc = t.col0 + c;
    float* dst = pr.out + ((q0 + gc / G) * pr.nh + t.kv_head * G + gc % G) * hd;
    const float inv = 1.f / w.l[c];
    for (int64_t d = 0; d < hd; ++d) dst[d] = w.o[c * hd + d] * inv;
  }
}

// Per ISA: 16 columns per vector for wide tasks, 8 for tasks of at most 8 columns (decode:
// one token x G heads), each with its half-width tail shape.
template <typename CacheT>
FT_TARGET_AVX512 void task_avx512(const Problem& pr, const Task& t, const Scratch& w) {
  using PV = PvShape<16, 6, 4>;
  if (t.col1 - t.col0 > 8) {
    run_task<PV, QkShape<16, 6, 4>, QkShape<8, 12, 2>, CacheT>(pr, t, w);
  } else {
    run_task<PV, QkShape<8, 12, 2>, QkShape<4, 12, 1>, CacheT>(pr, t, w);
  }
}
template <typename CacheT>
FT_TARGET_AVX2 void task_avx2(const Problem& pr, const Task& t, const Scratch& w) {
  run_task<PvShape<8, 3, 3>, QkShape<8, 3, 3>, QkShape<4, 3, 3>, CacheT>(pr, t, w);
}
template <typename CacheT>
void task_base(const Problem& pr, const Task& t, const Scratch& w) {
  using QK = QkShape<4, 3, 3>;
  run_task<PvShape<4, 3, 3>, QK, QK, CacheT>(pr, t, w);
}

// Per-thread scratch buffers, grown as needed, never shrunk. Every buffer starts on a 64-byte
// line: Q^T and S^T rows are a multiple of 16 floats, so their vector loads and stores never
// split a cache line (a split costs a second access).
struct ScratchBuffers {
  std::vector<float> f;
  std::vector<const float*> rows;

  Scratch get(int64_t hd, bool widened) {
    constexpr int64_t cw = kColTile, kt = kKeyTile, line = 16;
    const int64_t hd_up = (hd + line - 1) / line * line;
    const int64_t sizes[] = {hd * cw, kt * cw, cw * hd_up, cw, cw, cw,
                             widened ? kt * hd_up : 0, widened ? kt * hd_up : 0};
    int64_t total = line;  // room to align the start
    for (int64_t n : sizes) total += (n + line - 1) / line * line;
    if (f.size() < static_cast<size_t>(total)) f.resize(total);
    if (rows.size() < static_cast<size_t>(2 * kt)) rows.resize(2 * kt);
    float* p = f.data();
    p += (line - reinterpret_cast<uintptr_t>(p) / sizeof(float) % line) % line;
    float* part[8];
    for (int i = 0; i < 8; ++i) {
      part[i] = p;
      p += (sizes[i] + line - 1) / line * line;
    }
    Scratch w;
    w.qt = part[0];
    w.s = part[1];
    w.o = part[2];
    w.m = part[3];
    w.l = part[4];
    w.alpha = part[5];
    w.kw = widened ? part[6] : nullptr;
    w.vw = widened ? part[7] : nullptr;
    w.krow = rows.data();
    w.vrow = rows.data() + kt;
    return w;
  }
};

using TaskFn = void (*)(const Problem&, const Task&, const Scratch&);

template <typename CacheT>
TaskFn pick_task_fn() {
  const std::string isa = cpu_isa();  // cpuid-checked; follows set_cpu_isa
  if (isa == "avx512") return &task_avx512<CacheT>;
  if (isa == "avx2") return &task_avx2<CacheT>;
  return &task_base<CacheT>;
}

// Up to kColTile columns per task, the tiles of a sequence near-equal and multiples of 16.
void make_tasks(const Problem& pr, int64_t S, std::vector<Task>& tasks) {
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = pr.qsl[s + 1] - pr.qsl[s];
    if (nq == 0) continue;
    const int64_t cols = nq * pr.group;
    const int64_t ntiles = (cols + kColTile - 1) / kColTile;
    const int64_t tile = ((cols + ntiles - 1) / ntiles + 15) / 16 * 16;
    const int64_t first_pos = pr.seq_lens[s] - nq;
    for (int64_t c0 = 0; c0 < cols; c0 += tile) {
      const int64_t c1 = std::min(cols, c0 + tile);
      const int64_t hi = first_pos + (c1 - 1) / pr.group + 1;
      const int64_t lo = pr.window > 0
                             ? std::max<int64_t>(0, first_pos + c0 / pr.group - pr.window + 1)
                             : 0;
      const double cost = 2.0 * (hi - lo) * (c1 - c0 + 15) * pr.hd;
      for (int64_t h = 0; h < pr.kvh; ++h) tasks.push_back({s, h, c0, c1, cost});
    }
  }
  // Longest first, so the last task a thread picks up is a short one.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               double scale, int64_t window) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                        block_tables.device().is_cpu() && seq_lens.device().is_cpu() &&
                        query_start_loc.device().is_cpu(),
                    "paged_attention: CPU tensors only");
  TORCH_CHECK_VALUE(q.dim() == 3, "paged_attention: q must be [T, num_heads, head_dim], got ",
                    q.dim(), "-D");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  const auto fp = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK_VALUE(fp(qt) && fp(ct) && v_cache.scalar_type() == ct,
                    "paged_attention: q and the caches must be fp32, bf16 or fp16, and k_cache "
                    "and v_cache of one dtype; got ", qt, ", ", ct, ", ", v_cache.scalar_type());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "paged_attention: k_cache, v_cache must be [num_blocks, block_size, "
                    "num_kv_heads, head_dim] of one shape");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "paged_attention: k_cache and v_cache must be contiguous (a copy of the "
                    "pool per call would cost more than the attention)");
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == hd, "paged_attention: q has head_dim ", hd,
                    ", the caches ", k_cache.size(3));
  TORCH_CHECK_VALUE(hd >= 1 && bs >= 1 && kvh >= 1 && nh % kvh == 0,
                    "paged_attention: num_heads (", nh, ") must be a multiple of num_kv_heads (",
                    kvh, ")");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                        block_tables.is_contiguous(),
                    "paged_attention: block_tables must be contiguous int64 [S, max_blocks]");
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK_VALUE(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                        seq_lens.size(0) == S && seq_lens.is_contiguous(),
                    "paged_attention: seq_lens must be contiguous int64 [S] (S = ", S, ")");
  TORCH_CHECK_VALUE(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                        query_start_loc.size(0) == S + 1 && query_start_loc.is_contiguous(),
                    "paged_attention: query_start_loc must be contiguous int64 [S + 1] (S = ", S,
                    ")");
  TORCH_CHECK_VALUE(window >= 0, "paged_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(hd <= 1024 && nh / kvh <= 1024, "paged_attention: head_dim and the group "
                    "size must be <= 1024");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[S] == T, "paged_attention: query_start_loc must run from 0 "
                    "to T = ", T, ", got ", qsl[0], " .. ", qsl[S]);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = qsl[s + 1] - qsl[s], n = lens[s];
    TORCH_CHECK_VALUE(nq >= 0, "paged_attention: query_start_loc decreases at sequence ", s);
    if (nq == 0) continue;
    TORCH_CHECK_VALUE(n >= nq, "paged_attention: sequence ", s, " has seq_len ", n, " < its ",
                      nq, " query tokens");
    TORCH_CHECK_VALUE(n <= max_blocks * bs && n < (int64_t{1} << 31), "paged_attention: sequence ",
                      s, " has seq_len ", n, " for ", max_blocks, " blocks of ", bs);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, n - nq - window + 1) : 0;
    for (int64_t b = lo / bs; b < (n + bs - 1) / bs; ++b) {
      const int64_t blk = bt[s * max_blocks + b];
      TORCH_CHECK_VALUE(blk >= 0 && blk < NB, "paged_attention: sequence ", s, " block ", b,
                        " is ", blk, ", outside the pool of ", NB);
    }
  }

  // q as fp32 with unit head stride (a view into the qkv output is fine as it is).
  at::Tensor q32 = q;
  if (qt != at::kFloat || q.stride(2) != 1 || q.stride(1) != hd) q32 = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, nh, hd}, q.options().dtype(at::kFloat));
  Problem pr{q32.data_ptr<float>(), q32.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
             bt, max_blocks, lens, qsl, out.data_ptr<float>(), nh, kvh, hd, bs, nh / kvh,
             static_cast<float>(scale), window};
  std::vector<Task> tasks;
  make_tasks(pr, S, tasks);
  double total = 0;
  for (const Task& t : tasks) total += t.cost;
  // ~100 GFLOP/s on one core when the kernel is FMA-bound (2 flops per multiply-add).
  const int nthreads = total * 2 / 100.0 < kInlineNs ? 1 : at::get_num_threads();
  const bool widened = ct != at::kFloat;
  TaskFn fn = ct == at::kFloat      ? pick_task_fn<float>()
              : ct == at::kBFloat16 ? pick_task_fn<c10::BFloat16>()
                                    : pick_task_fn<c10::Half>();
  TaskPool::get().run(static_cast<int64_t>(tasks.size()), nthreads, [&](int64_t i) {
    thread_local ScratchBuffers buffers;
    fn(pr, tasks[i], buffers.get(hd, widened));
  });
  return qt == at::kFloat ? out : out.to(qt);
}

}  // namespace freetoken
