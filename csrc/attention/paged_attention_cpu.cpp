// Paged attention on the CPU for any number of query tokens per sequence (decode, prefill, a
// prompt behind a cached prefix, chunks): K/V read in place from the paged pool, causal, GQA, an
// optional sliding window; optionally the step's new K/V written into the pool first (write_kv).
// The micro-kernels are in paged_attention_kernels.h; here: the tasks, one task's walk over its
// key tiles (softmax, mask), the scratch, the checks and the op.
//
// Size: the task split, the tile walk and the scratch are one algorithm; splitting them would
// pass their shared state across files.
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
// The two products are out-of-line per ISA (see FT_ATTENTION_KERNELS): inlined, GCC spilled the
// key pointers. K/V rows are prefetched into L2 32 keys ahead (prefetch_rows: cold decode
// ~1.4x).
//
// Batch invariance (issue 23): a column's result depends only on its own query and keys. Each
// score is one FMA chain over d, each column's softmax sum and O one chain over its keys in
// tiles at fixed multiples of kKeyTile (keys a column cannot see are -inf, adding exact zeros),
// whatever the other columns of its task, the task split, the threads or how many query tokens
// the step has, and a decode task (one query token, run_decode) computes the same sums in the
// same order, vectorized across keys instead of across its few columns: a token has the same
// bits decoded or scored as part of a prompt.
//
// Numerics: fp32 scores, softmax and sums (as SDPA on CPU); q pre-scaled; exp by a polynomial
// (error < 2e-7 relative; std::exp does not vectorize without -ffast-math). bf16 / fp16 pools
// are widened exactly into a per-tile fp32 copy. The result is fp32 (the caller casts).
//
// ISA: one body compiled for AVX-512, AVX2+FMA and baseline x86-64 through target attributes,
// chosen per call by freetoken::current_isa() (common/isa.h; set_cpu_isa), like
// linear_cpu.cpp; no -march. Threads: csrc/common/task_pool.h (at::parallel_for is serial here);
// a call estimated to be short stays on the caller.
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

#include "attention/paged_attention_cpu.h"
#include "attention/paged_attention_kernels.h"
#include "common/isa.h"
#include "common/task_pool.h"

namespace freetoken {
namespace {

using namespace paged_attention_kernels;  // NOLINT: this file's own micro-kernels

constexpr int64_t kKeyTile = 256;  // keys per softmax step: S^T tile <= 256 x 96 fp32 (L2)
constexpr int64_t kColTile = 96;   // the most query columns per task (a multiple of 16)
// NOTE: waking a helper costs ~10-40 us here; a call estimated under this on one thread runs on
// the caller alone.
constexpr double kInlineNs = 60e3;

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

// w.krow / w.vrow [0, n): the K and V rows of keys k0 .. k0 + n - 1 of task t, in the pool
// (fp32) or widened into w.kw / w.vw; block by block (no division per key).
template <typename CacheT>
FT_INLINE void row_pointers(const Problem& pr, const Task& t, const Scratch& w, int64_t k0,
                            int64_t n) {
  const int64_t hd = pr.hd, row_len = pr.kvh * hd;
  const int64_t* blocks = pr.block_tables + t.seq * pr.max_blocks;
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
}

// Q^T [hd, cw] of task t, scaled: column c is the query of the task's column min(c, nc - 1)
// (padding columns repeat the last real one; their lanes are unused). L x L blocks at a time by
// register transposes where cw and hd are multiples of L, else element by element (the same
// products: one multiply each).
// NOTE: element by element, the stores went down Q^T's rows a line apart: a fifth of the
// classify tasks' own time (1B shapes: 8 x 28 queries, 32 heads, 8 kv heads), outside QK and PV.
template <int L>
FT_INLINE void pack_qt(const Problem& pr, const Task& t, const Scratch& w, int64_t cw,
                       int64_t nc, int64_t q0) {
  using vf = typename Vec<L>::f;
  const int64_t hd = pr.hd, G = pr.group;
  const auto row = [&](int64_t c) {
    const int64_t gc = t.col0 + std::min(c, nc - 1);
    return pr.q + (q0 + gc / G) * pr.q_row + (t.kv_head * G + gc % G) * hd;
  };
  if (cw % L != 0 || hd % L != 0) {
    for (int64_t c = 0; c < cw; ++c) {
      const float* qr = row(c);
      for (int64_t d = 0; d < hd; ++d) w.qt[d * cw + c] = qr[d] * pr.scale;
    }
    return;
  }
  for (int64_t c0 = 0; c0 < cw; c0 += L) {
    const float* r[L];
#pragma GCC unroll 16
    for (int i = 0; i < L; ++i) r[i] = row(c0 + i);
    for (int64_t d0 = 0; d0 < hd; d0 += L) {
      vf v[L];
#pragma GCC unroll 16
      for (int i = 0; i < L; ++i) v[i] = loadu<L>(r[i] + d0) * pr.scale;
      vec::transpose<L>(v);
#pragma GCC unroll 16
      for (int i = 0; i < L; ++i) storeu<L>(w.qt + (d0 + i) * cw + c0, v[i]);
    }
  }
}

// One task, with one ISA's kernels K.
// A task of one query token and at most 8 columns (decode: the G heads of one kv head): run_task's
// sums in run_task's order (the same bits), vectorized across keys instead of across the few
// columns. S [cols, keys] (row stride kKeyTile) by qk_keys; per column its max, exp and sum
// (kSumParts parts) along its keys; O += P V by pv_cols, one chain over the keys as pv.
template <class K, typename CacheT>
FT_INLINE void run_decode(const Problem& pr, const Task& t, const Scratch& w) {
  constexpr int L = K::kL;
  constexpr int LS = L < kSumParts ? L : kSumParts;  // lanes of the sum's vectors
  constexpr int64_t kPad = L > kSumParts ? L : kSumParts;
  using vf = typename Vec<L>::f;
  using vs = typename Vec<LS>::f;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t ss = kKeyTile, cw = 8;
  const int64_t hd = pr.hd, G = pr.group, nc = t.col1 - t.col0;
  const int64_t q0 = pr.qsl[t.seq], token = t.col0 / G;
  const int64_t pos = pr.seq_lens[t.seq] - (pr.qsl[t.seq + 1] - q0) + token;
  pack_qt<L>(pr, t, w, cw, nc, q0);
  for (int64_t c = 0; c < nc; ++c) {
    w.m[c] = kNegInf;
    w.l[c] = 0.f;
  }
  std::memset(w.o, 0, sizeof(float) * nc * hd);
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
  for (int64_t k0 = lo / kKeyTile * kKeyTile; k0 <= pos; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, pos + 1 - k0), n_pad = (n + kPad - 1) / kPad * kPad;
    row_pointers<CacheT>(pr, t, w, k0, n);
    for (int64_t j = n; j < n_pad; ++j) w.krow[j] = w.krow[n - 1];
    prefetch_rows(w, 0, std::min(n, kPrefetchKeys), hd);
    K::qk_one_token(w, n_pad, nc, cw, hd, ss);
    const int64_t hidden = std::clamp<int64_t>(lo - k0, 0, n);  // keys the window hides
    for (int64_t c = 0; c < nc; ++c) {
      float* row = w.s + c * ss;
      for (int64_t j = 0; j < hidden; ++j) row[j] = kNegInf;
      for (int64_t j = n; j < n_pad; ++j) row[j] = kNegInf;
      const float m_old = w.m[c];
      vf mx = splat<L>(m_old);
      for (int64_t j = 0; j < n_pad; j += L) {
        const vf x = loadu<L>(row + j);
        mx = x > mx ? x : mx;
      }
      float m_new = mx[0];
      for (int i = 1; i < L; ++i) m_new = std::max(m_new, mx[i]);
      const float shift = m_new == kNegInf ? 0.f : m_new;
      for (int64_t j = 0; j < n_pad; j += L)
        storeu<L>(row + j, exp_nonpositive<L>(loadu<L>(row + j) - shift));
      vs part[kSumParts / LS] = {};
      for (int64_t j = 0; j < n_pad; j += kSumParts)
#pragma GCC unroll 8
        for (int u = 0; u < kSumParts / LS; ++u) part[u] += loadu<LS>(row + j + u * LS);
      float parts[kSumParts];
      for (int u = 0; u < kSumParts; ++u) parts[u] = part[u / LS][u % LS];
      const float a = exp_nonpositive<L>(splat<L>(m_old - shift))[0];
      w.alpha[c] = a;
      w.l[c] = w.l[c] * a + sum_parts(parts);
      w.m[c] = m_new;
    }
    K::pv_cols(w, n, nc, ss, hd);
  }
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t gc = t.col0 + c;
    float* dst = pr.out + ((q0 + token) * pr.nh + t.kv_head * G + gc % G) * hd;
    const float inv = 1.f / w.l[c];
    for (int64_t d = 0; d < hd; ++d) dst[d] = w.o[c * hd + d] * inv;
  }
}

template <class K, typename CacheT>
FT_INLINE void run_task(const Problem& pr, const Task& t, const Scratch& w) {
  constexpr int LC = K::kLC;
  using vf = typename Vec<LC>::f;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t hd = pr.hd, G = pr.group, s = t.seq;
  const int64_t nc = t.col1 - t.col0, nv = (nc + LC - 1) / LC, cw = nv * LC;
  if (nc <= 8 && t.col0 / G == (t.col1 - 1) / G) return run_decode<K, CacheT>(pr, t, w);
  const int64_t seq_len = pr.seq_lens[s], q0 = pr.qsl[s];
  const int64_t first_pos = seq_len - (pr.qsl[s + 1] - q0);
  // Columns are in token order, so column c's query position is non-decreasing in c.
  const auto pos_of = [&](int64_t c) { return first_pos + (t.col0 + c) / G; };

  pack_qt<LC>(pr, t, w, cw, nc, q0);
  for (int64_t c = 0; c < cw; ++c) {
    w.m[c] = kNegInf;
    w.l[c] = 0.f;
  }
  std::memset(w.o, 0, sizeof(float) * nc * hd);
  // NOTE: tiles start at multiples of kKeyTile, not at the task's first visible key: the tile
  // bounds, and so every column's sums, stay the same whatever the task's first column.
  const int64_t key_lo =
      pr.window > 0 ? std::max<int64_t>(0, pos_of(0) - pr.window + 1) / kKeyTile * kKeyTile : 0;
  const int64_t key_hi = pos_of(nc - 1) + 1;
  // A half-full last vector goes through QKT.
  const int64_t tail_real = nc - (nv - 1) * LC;
  const bool narrow_tail = K::kTailLC < LC && tail_real <= K::kTailLC;

  for (int64_t k0 = key_lo; k0 < key_hi; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, key_hi - k0);
    row_pointers<CacheT>(pr, t, w, k0, n);
    prefetch_rows(w, 0, std::min(n, kPrefetchKeys), hd);
    // S^T = K Q^T, per group of column vectors only over the keys some column in it can see
    // (the mask below hides the rest).
    const int64_t full_vecs = narrow_tail ? nv - 1 : nv;
    for (int64_t v0 = 0; v0 < full_vecs; v0 += K::kNP) {
      const int64_t v1 = std::min(full_vecs, v0 + K::kNP);
      const int64_t last = std::min(nc - 1, v1 * LC - 1);
      const int64_t keys = std::min(n, pos_of(last) + 1 - k0);
      K::qk(w, keys, v0 * LC, v1 - v0, cw, hd);
    }
    if (narrow_tail) K::qk_tail(w, n, (nv - 1) * LC, cw, hd);
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
      // the sum in kSumParts parts (paged_attention_kernels.h), as run_decode sums it
      vf part[kSumParts];
#pragma GCC unroll 8
      for (int u = 0; u < kSumParts; ++u) part[u] = vf{};
      for (j = 0; j + kSumParts <= n; j += kSumParts)
#pragma GCC unroll 8
        for (int u = 0; u < kSumParts; ++u) {
          float* row = w.s + (j + u) * cw + v * LC;
          const vf e = exp_nonpositive<LC>(loadu<LC>(row) - shift);
          storeu<LC>(row, e);
          part[u] += e;
        }
      for (int u = 0; j < n; ++j, ++u) {
        float* row = w.s + j * cw + v * LC;
        const vf e = exp_nonpositive<LC>(loadu<LC>(row) - shift);
        storeu<LC>(row, e);
        part[u] += e;
      }
      const vf sum = sum_parts(part);
      const vf a = exp_nonpositive<LC>(m_old - shift);  // (sum: the parts, below)
      storeu<LC>(w.alpha + v * LC, a);
      storeu<LC>(w.l + v * LC, loadu<LC>(w.l + v * LC) * a + sum);
      storeu<LC>(w.m + v * LC, m_new);
    }
    K::pv(w, n, nc, cw, hd, first_pos + 1 - k0, t.col0, G);
  }
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t gc = t.col0 + c;
    float* dst = pr.out + ((q0 + gc / G) * pr.nh + t.kv_head * G + gc % G) * hd;
    const float inv = 1.f / w.l[c];
    for (int64_t d = 0; d < hd; ++d) dst[d] = w.o[c * hd + d] * inv;
  }
}

template <typename CacheT>
FT_TARGET_AVX512 void task_avx512(const Problem& pr, const Task& t, const Scratch& w) {
  if (t.col1 - t.col0 > 8) {
    run_task<Avx512Wide, CacheT>(pr, t, w);
  } else {
    run_task<Avx512Narrow, CacheT>(pr, t, w);
  }
}
template <typename CacheT>
FT_TARGET_AVX2 void task_avx2(const Problem& pr, const Task& t, const Scratch& w) {
  run_task<Avx2Kernels, CacheT>(pr, t, w);
}
template <typename CacheT>
void task_base(const Problem& pr, const Task& t, const Scratch& w) {
  run_task<BaseKernels, CacheT>(pr, t, w);
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
    const int64_t sizes[] = {hd_up * cw, kt * cw, cw * hd_up, cw, cw, cw,
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
  const Isa isa = current_isa();  // cpuid-checked; follows set_cpu_isa
  if (isa == Isa::kAvx512) return &task_avx512<CacheT>;
  if (isa == Isa::kAvx2) return &task_avx2<CacheT>;
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

// k, v [T, kvh, hd] into the pools' rows at slot_mapping [T] (the step's new K/V), cast to the
// pool's dtype as torch's .to() would. In the op: the two index_copy_ it replaces cost ~8-18 us
// per layer in dispatch alone.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping,
              const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t T = k.size(0), kvh = k_cache.size(2), hd = k_cache.size(3);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK_VALUE(x->device().is_cpu() && x->dim() == 3 && x->size(0) == T &&
                          x->size(1) == kvh && x->size(2) == hd && x->stride(2) == 1 &&
                          x->stride(1) == hd,
                      "paged_attention: k and v must be [T, num_kv_heads, head_dim] = [", T, ", ",
                      kvh, ", ", hd, "] with contiguous heads, got ", x->sizes());
  TORCH_CHECK_VALUE(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                        slot_mapping.is_contiguous(),
                    "paged_attention: slot_mapping must be contiguous int64 [T] (T = ", T, ")");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(slot[t] >= 0 && slot[t] < slots, "paged_attention: slot_mapping[", t,
                      "] is ", slot[t], ", outside the pool of ", slots, " slots");
  const auto ct = k_cache.scalar_type();
  // A dtype other than the pool's is cast by torch first (rare: the model's dtype is the pool's).
  const at::Tensor kc = k.scalar_type() == ct ? k : k.to(ct);
  const at::Tensor vc = v.scalar_type() == ct ? v : v.to(ct);
  const int64_t row = kvh * hd * static_cast<int64_t>(k_cache.element_size());
  char* kp = static_cast<char*>(k_cache.data_ptr());
  char* vp = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  const int64_t ks_row = kc.stride(0) * kc.element_size(), vs_row = vc.stride(0) * vc.element_size();
  const auto copy = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(kp + slot[t] * row, ks + t * ks_row, row);
      std::memcpy(vp + slot[t] * row, vs + t * vs_row, row);
    }
  };
  // NOTE: the new rows land in blocks no step has touched lately, a cache miss a line: a classify
  // step's 224 tokens (1B: 2 x 448 KiB a layer) took 0.22-0.26 ms a layer on one thread, 0.10-0.12
  // on two (scripts/bench_attention.py --heads 32 --kv-heads 8: kernel less kernel_read).
  const int nthreads = T * row < (int64_t{1} << 17) ? 1 : at::get_num_threads();
  if (nthreads == 1) return copy(0, T);
  const int64_t n = 2 * nthreads;
  TaskPool::get().run(n, nthreads, [&](int64_t i) { copy(T * i / n, T * (i + 1) / n); });
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               double scale, int64_t window, const c10::optional<at::Tensor>& k,
                               const c10::optional<at::Tensor>& v,
                               const c10::optional<at::Tensor>& slot_mapping) {
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

  TORCH_CHECK_VALUE(k.has_value() == v.has_value() && k.has_value() == slot_mapping.has_value(),
                    "paged_attention: pass k, v and slot_mapping together, or none of them");
  if (k.has_value()) write_kv(*k, *v, *slot_mapping, k_cache, v_cache);

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
