// The panel linear: y [M, N] = x [M, K] @ W^T (+ bias), fp32, for decode's few query rows, over W
// packed once into column panels.
//
// Why: a decode step reads every weight once and does little else with it (2 M flops per weight
// read), so it is bound by DRAM bandwidth. oneDNN's packed fp32 linear (freetoken/model/linear.py)
// reads cold weights at ~16-18 GB/s for M <= 8 here, well under what a plain streaming read gets.
// This kernel streams each thread's weights as long contiguous runs of cache lines.
//
// Layout: panel p holds columns [16 p, 16 p + 16) of y as [K, 16]: row k is W[16 p .. 16 p + 15,
// k], one 64-byte line. Panels follow each other, so a range of panels is one stream.
//
// Micro-kernel: for a chunk of MR rows of x (templated, 1..16 on AVX-512) and NP panels, MR x 16
// fp32 accumulators a panel; per k one row of each panel is loaded and x[m, k] broadcast from
// memory into the NP FMAs. Small MR takes more panels at once (8 panels at one row on AVX-512),
// so 8+ independent FMA chains hide the latency while every output stays one chain over k.
// Rows beyond MR_max are cut into equal chunks; the thread then walks an L2-sized block of its
// panels once per chunk, so the weights still come from DRAM once, and pulls the next block into
// L2 meanwhile. Those chunks (AVX-512: <= 14 rows) take two panels at a time, each broadcast of x
// feeding two FMAs: with one panel a core with two 512-bit FMA ports waits on loads (classify's
// 224 rows on a Sapphire-Rapids-class Xeon, one thread: 119 -> 159 GFLOP/s hot).
//
// Size: the packing, the micro-kernels and their dispatch share the panel layout's constants
// and the block walk; they are one algorithm in one file.
//
// Threads: the panels are cut into a few contiguous ranges (>= 512 KB of weights each) that the
// caller and torch.get_num_threads() - 1 helpers of a small pool claim in order; a call estimated
// under ~20 us on one thread stays on the caller. The packed buffer asks for 2 MB pages.
//
// Numerics: fp32 products and sums (FMA where the ISA has one). Every output is one FMA chain over
// k = 0, 1, ..., K - 1, then + bias, whatever the row count, the chunk, the panel group or the
// thread: a row's result does not depend on the rows computed with it (batch invariance, issue
// 23; quant_linear_cpu.cpp sums in the same order, so the GGUF-block panels give these bits too).
//
// GGUF-block panels (quant_linear_cpu.cpp) of more than gguf_few_rows() rows come here too: each
// thread decodes an L2-sized block of its panels at a time into fp32 panels in a buffer of its
// own (run_decoded), then runs the fp32 micro-kernels over it: the fp32 panels' bits, with no
// fp32 copy of the weight anywhere.
//
// bf16: the same panels hold bf16 weights (half the bytes: a decode step is twice as short a
// stream); each panel row is widened to fp32 exactly (a 16-bit shift) and everything after is
// the fp32 kernel; bf16 x is widened into the transposed copy, y is rounded to bf16 at the end
// (as oneDNN's bf16 linear: fp32 accumulation, one rounding of the output).
//
// ISA: one body, compiled for AVX-512, AVX2+FMA and baseline x86-64 through target attributes and
// chosen per call by freetoken::current_isa() (common/isa.h; set_cpu_isa), like
// elementwise_cpu.cpp; no -march.
#include "linear/linear_cpu.h"
#include "linear/gguf_linear.h"
#include "linear/int8_linear.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/isa.h"
#include "common/task_pool.h"
#include "linear/panel_common.h"

namespace freetoken {
namespace {


using panel::in_register;
using panel::kNR;
using panel::loadu;
using panel::Vec;

constexpr int64_t kBlockBytes = 256 << 10;  // panels walked per row chunk when M > MR_max
// Software prefetch (prefetcht1, this far ahead in the weight stream) only for chunks of at
// least kPrefetchMinRows rows: measured cold at 3072 x 576, one thread, 2 MB pages, it took M = 8
// from 16 to 23 GB/s and M = 16 from 8.5 to 11 GB/s, but cost M = 1..4 ~10% (the hardware
// prefetcher already keeps up when the FMAs per line are few).
constexpr int64_t kPrefetchBytes = 8192;
constexpr int kPrefetchMinRows = 6;
// NOTE: x is transposed into row chunks before the FMAs (module comment). On the classify step
// (8 x 28 rows) the scalar transpose on the caller, while the helper waited, cost 4-9 % of the
// forward (in-process A/B); a call with at least this many elements of x splits its chunks over
// the pool.
constexpr int64_t kTransposeSplitElements = int64_t{1} << 15;

template <typename WT>
struct Args {
  const float* x;     // row chunks of x, each [K, mr] (transposed, so broadcasts share a line)
  const WT* w;        // panels [P, K, kNR], fp32 or bf16 (uint16_t)
  const float* bias;  // [N] or null
  float* y;           // [M, N], row stride N
  int64_t M, N, K;
  // GGUF-block panels (pack_gguf_panels) for many rows: w is then each thread's buffer of a
  // block of them decoded (run_decoded), whose first panel is p_base.
  const panel::Header* gguf = nullptr;
  const uint8_t* blocks = nullptr;
  int64_t p_base = 0;
  int64_t ldx = 0;  // the row stride of x where it is read in place (XIN; panel::x_row_stride)
};

// One panel row's L weights as fp32: a load, and for bf16 the exact widening (bits << 16).
template <int L>
FT_INLINE typename Vec<L>::f load_w(const float* p) {
  return loadu<L>(p);
}
template <int L>
FT_INLINE typename Vec<L>::f load_w(const uint16_t* p) {
  typename Vec<L>::h h;
  std::memcpy(&h, p, sizeof h);
  const typename Vec<L>::u w = __builtin_convertvector(h, typename Vec<L>::u) << 16;
  typename Vec<L>::f v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// The weights of the next block of panels (run), pulled into L2 a line every `every` k steps of
// the micro-kernels while they compute on this block. Without it the first row chunk's pass over
// a block waited on DRAM: one core streams ~11 GB/s here, and that pass wants twice that; the
// later chunks find the block in L2.
struct Ahead {
  const char* p;    // the next line to pull
  const char* end;  // the end of the next block
  int64_t every;
};

// Rows [r0, r0 + MR) of y, panels [p0, p0 + NP): the micro-kernel, L = floats per vector. NP
// panels share each broadcast of x: with one panel every FMA brings its own load of x (MR + 1
// loads per MR FMAs), which on cores with two 512-bit FMA ports is what limits them. AHEAD: the
// k loop also pulls in the next block's lines (Ahead).
template <int L, int MR, int NP, bool PF, bool AHEAD, bool XIN, typename WT>
FT_INLINE void panel_group(const Args<WT>& a, int64_t r0, int64_t p0, Ahead& ahead) {
  using vf = typename Vec<L>::f;
  constexpr int V = kNR / L;  // vectors per panel row
  const int64_t K = a.K;
  // XIN: row m of the chunk at x + m * ldx, else the chunk [K, MR] at r0 * K
  const int64_t ldx = a.ldx;
  const float* x = a.x + r0 * (XIN ? ldx : K);
  const WT* wp[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) wp[j] = a.w + (p0 + j - a.p_base) * K * kNR;
  vf acc[NP][MR][V];  // each output: one chain over k
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) panel::zero(acc[j]);
  int64_t countdown = ahead.every;
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (AHEAD) {
      if (--countdown == 0) {
        countdown = ahead.every;
        if (ahead.p < ahead.end) {
          __builtin_prefetch(ahead.p, 0, 2);  // t1
          ahead.p += 64;
        }
      }
    }
    vf wv[NP][V];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const WT* row = wp[j] + k * kNR;
      if constexpr (PF)  // t1
        __builtin_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, 0, 2);
#pragma GCC unroll 64
      for (int v = 0; v < V; ++v) wv[j][v] = in_register(load_w<L>(row + v * L));
    }
#pragma GCC unroll 64
    for (int m = 0; m < MR; ++m) {
      const float xs = XIN ? x[m * ldx + k] : x[k * MR + m];
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
#pragma GCC unroll 64
        for (int v = 0; v < V; ++v) acc[j][m][v] += wv[j][v] * xs;
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j)
    panel::store_sums<L>(acc[j], a.y + r0 * a.N, a.N, (p0 + j) * kNR, a.bias);
}

// Rows [r0, r0 + MR) of y, panels [p0, p1), NP panels a group (panel::group_panels), then the
// rest in halving groups: the group changes how many chains run at once, never an output's sum.
template <int L, int MR, int NP, bool AHEAD, bool XIN, typename WT>
FT_INLINE void panel_groups(const Args<WT>& a, int64_t r0, int64_t p0, int64_t p1,
                            Ahead& ahead) {
  constexpr bool kPF = MR >= kPrefetchMinRows;
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) panel_group<L, MR, NP, kPF, AHEAD, XIN>(a, r0, p, ahead);
  if constexpr (NP > 1) {
    if (p < p1) panel_groups<L, MR, NP / 2, AHEAD, XIN>(a, r0, p, p1, ahead);
  }
}

// Rows [r0, r0 + MR) of y, panels [p0, p1): pairs of panels where NP2 (the kernel's row count
// allows two panels' accumulators in registers), else as many as 8 FMA chains want.
template <int L, int MR, bool NP2, bool AHEAD, bool XIN, typename WT>
FT_INLINE void panels(const Args<WT>& a, int64_t r0, int64_t p0, int64_t p1, Ahead& ahead) {
  constexpr int NP = NP2 ? 2 : panel::group_panels(MR * (kNR / L), panel::kChains);
  panel_groups<L, MR, NP, AHEAD, XIN>(a, r0, p0, p1, ahead);
}

// MR from the run-time row count mr: one instantiation per value, 1..MR for single panels and
// kMinPairRows..MR for pairs (row_chunks never gives a paired kernel fewer rows).
constexpr int kMinPairRows = 8;
template <int L, int MR, bool NP2, bool AHEAD, bool XIN = false, typename WT>
FT_INLINE void panels_rows(const Args<WT>& a, int mr, int64_t r0, int64_t p0, int64_t p1,
                           Ahead& ahead) {
  if constexpr (MR > (NP2 ? kMinPairRows : 1)) {
    if (mr < MR) return panels_rows<L, MR - 1, NP2, AHEAD, XIN>(a, mr, r0, p0, p1, ahead);
  }
  panels<L, MR, NP2, AHEAD, XIN>(a, r0, p0, p1, ahead);
}

// How x's rows are cut into equal chunks (the transposed copy and the micro-kernels agree on
// it): at most mr_max rows, one chunk up to mr_max; past that, where the ISA has a paired
// kernel (mr_pairs > 0), at most mr_pairs rows so two panels' accumulators fit the registers.
int64_t row_chunks(int64_t M, int64_t mr_max, int64_t mr_pairs) {
  const int64_t mr = M <= mr_max || mr_pairs == 0 ? mr_max : mr_pairs;
  return (M + mr - 1) / mr;
}

// GGUF-block panels [p0, p1) for every row: each L2-sized block of them is decoded once into
// this thread's buffer (their exact fp32 weights), then every row chunk walks it with the fp32
// micro-kernels: the fp32 panels' bits, and the decoding (~4 vector ops per 16 weights) is
// shared by all the step's rows.
template <int L, int MRMAX, int MRPAIRS>
FT_INLINE void run_decoded(const Args<float>& a, int64_t p0, int64_t p1) {
  const int64_t chunks = row_chunks(a.M, MRMAX, MRPAIRS);
  const int64_t panel = a.K * kNR * static_cast<int64_t>(sizeof(float));
  const int64_t block = std::max<int64_t>(2, kBlockBytes / panel & ~1);
  thread_local std::vector<float> store;
  store.resize(static_cast<size_t>(block * a.K * kNR + 16));
  float* buf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) &
                                        ~uintptr_t{63});
  // The first byte of p's group of panels (every group before it is whole), or the end.
  const auto group_start = [&](int64_t p) {
    return reinterpret_cast<const char*>(a.blocks) +
           std::min(a.gguf->P, p / panel::kGGUFGroup * panel::kGGUFGroup) *
               panel::panel_bytes(a.gguf->format, a.K);
  };
  for (int64_t b0 = p0; b0 < p1; b0 += block) {
    const int64_t b1 = std::min(p1, b0 + block), next = std::min(p1, b1 + block);
    panel::decode_gguf_panels(*a.gguf, a.blocks, b0, b1, buf);
    Args<float> d = a;
    d.w = buf;
    d.p_base = b0;
    // The next block's blocks (whole groups) pulled into L2 over this block's passes.
    const char* lo = group_start(b1);
    const char* hi = group_start(next + panel::kGGUFGroup - 1);
    const int64_t steps = chunks * (b1 - b0) * a.K / (MRPAIRS > 0 && chunks > 1 ? 2 : 1);
    Ahead ahead{lo, hi, std::max<int64_t>(1, steps / ((hi - lo) / 64 + 1))};
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = a.M * c / chunks, r1 = a.M * (c + 1) / chunks;
      const int mr = static_cast<int>(r1 - r0);
      if constexpr (MRPAIRS > 0) {
        if (chunks > 1) {  // as run: pairs of panels past one chunk
          panels_rows<L, MRPAIRS, true, true, true>(d, mr, r0, b0, b1, ahead);
          continue;
        }
      }
      panels_rows<L, MRMAX, false, true, true>(d, mr, r0, b0, b1, ahead);
    }
  }
}

// Panels [p0, p1) for every row: rows cut into equal chunks (row_chunks); with more than one
// chunk each walks an L2-sized block of panels in turn, so the weights come from DRAM once,
// while the next block is pulled in (Ahead).
template <int L, int MRMAX, int MRPAIRS, typename WT>
FT_INLINE void run(const Args<WT>& a, int64_t p0, int64_t p1) {
  if constexpr (std::is_same_v<WT, float>) {
    if (a.gguf != nullptr) return run_decoded<L, MRMAX, MRPAIRS>(a, p0, p1);
  }
  const int64_t chunks = row_chunks(a.M, MRMAX, MRPAIRS);
  Ahead none{nullptr, nullptr, 1};
  if (chunks == 1)
    return panels_rows<L, MRMAX, false, false>(a, static_cast<int>(a.M), 0, p0, p1, none);
  // An even number of panels a block where they go in pairs.
  const int64_t panel = a.K * kNR * static_cast<int64_t>(sizeof(WT));
  const int64_t block = std::max<int64_t>(
      MRPAIRS > 0 ? 2 : 1, kBlockBytes / panel & (MRPAIRS > 0 ? ~1 : ~0));
  const char* w = reinterpret_cast<const char*>(a.w);
  for (int64_t b0 = p0; b0 < p1; b0 += block) {
    const int64_t b1 = std::min(p1, b0 + block), next = std::min(p1, b1 + block);
    // The k steps of this block's passes (one per chunk) spread over the next block's lines.
    const int64_t steps = chunks * (b1 - b0) * a.K / (MRPAIRS > 0 ? 2 : 1);
    const int64_t lines = (next - b1) * panel / 64;
    Ahead ahead{w + b1 * panel, w + next * panel, std::max<int64_t>(1, steps / (lines + 1))};
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = a.M * c / chunks, r1 = a.M * (c + 1) / chunks;
      if constexpr (MRPAIRS > 0) {
        panels_rows<L, MRPAIRS, true, true>(a, static_cast<int>(r1 - r0), r0, b0, b1, ahead);
      } else {
        panels_rows<L, MRMAX, false, true>(a, static_cast<int>(r1 - r0), r0, b0, b1, ahead);
      }
    }
  }
}

// Chunk c of `chunks` (module comment: rows cut into equal chunks, each [K, mr] at offset
// r0 * K of xt): fp32 rows by L x L register transposes, L k at a time. A k's L lanes are
// stored whole where they stay inside the chunk: the lanes past mr are overwritten by the next
// k's stores, which come after.
template <int L>
FT_INLINE void transpose_chunk(const float* x, int64_t M, int64_t K, int64_t c, int64_t chunks,
                               float* xt) {
  using vf = typename Vec<L>::f;
  const int64_t r0 = M * c / chunks, mr = M * (c + 1) / chunks - r0;
  const float* rows = x + r0 * K;
  float* o = xt + r0 * K;
  int64_t k0 = 0;
  for (; k0 + L <= K; k0 += L) {
    vf t[L];
#pragma GCC unroll 16
    for (int m = 0; m < L; ++m) t[m] = loadu<L>(rows + std::min<int64_t>(m, mr - 1) * K + k0);
    vec::transpose<L>(t);
#pragma GCC unroll 16
    for (int j = 0; j < L; ++j) {
      float* dst = o + (k0 + j) * mr;
      if ((k0 + j) * mr + L <= K * mr) {
        std::memcpy(dst, &t[j], sizeof(vf));
      } else {
        for (int64_t m = 0; m < mr; ++m) dst[m] = t[j][m];
      }
    }
  }
  for (; k0 < K; ++k0)
    for (int64_t m = 0; m < mr; ++m) o[k0 * mr + m] = rows[m * K + k0];
}

// bf16 rows are widened one by one (exact), L k of every row at a time.
template <int L>
FT_INLINE void transpose_chunk(const c10::BFloat16* x, int64_t M, int64_t K, int64_t c,
                               int64_t chunks, float* xt) {
  const int64_t r0 = M * c / chunks, mr = M * (c + 1) / chunks - r0;
  float* o = xt + r0 * K;
  for (int64_t k0 = 0; k0 < K; k0 += L)
    for (int64_t m = 0; m < mr; ++m) {
      const c10::BFloat16* row = x + (r0 + m) * K;
      for (int64_t k = k0; k < std::min(K, k0 + L); ++k) o[k * mr + m] = static_cast<float>(row[k]);
    }
}

// Registers: AVX-512 has 32 of one panel row each; AVX2 16 of half a row; SSE2 16 of a quarter.
// The transposes' chunks (<= MRMAX rows) fit a vector's L lanes on each.
// Pairs on AVX-512 only: 14 rows x 2 panels are 28 accumulators, plus the two panel rows and a
// broadcast (AVX2 would be down to 3 rows a pair: no fewer loads per FMA than one panel of 6).
template <typename WT>
FT_TARGET_AVX512 void run_avx512(const Args<WT>& a, int64_t p0, int64_t p1) {
  run<16, 16, 14>(a, p0, p1);
}
template <typename WT>
FT_TARGET_AVX2 void run_avx2(const Args<WT>& a, int64_t p0, int64_t p1) {
  run<8, 6, 0>(a, p0, p1);
}
template <typename WT>
void run_base(const Args<WT>& a, int64_t p0, int64_t p1) {
  run<4, 2, 0>(a, p0, p1);
}
template <typename XT>
FT_TARGET_AVX512 void transpose_avx512(const XT* x, int64_t M, int64_t K, int64_t c,
                                       int64_t chunks, float* xt) {
  transpose_chunk<16>(x, M, K, c, chunks, xt);
}
template <typename XT>
FT_TARGET_AVX2 void transpose_avx2(const XT* x, int64_t M, int64_t K, int64_t c, int64_t chunks,
                                   float* xt) {
  transpose_chunk<8>(x, M, K, c, chunks, xt);
}
template <typename XT>
void transpose_base(const XT* x, int64_t M, int64_t K, int64_t c, int64_t chunks, float* xt) {
  transpose_chunk<4>(x, M, K, c, chunks, xt);
}

template <typename WT, typename XT>
struct Kernel {
  void (*run)(const Args<WT>&, int64_t, int64_t);
  void (*transpose)(const XT*, int64_t, int64_t, int64_t, int64_t, float*);
  int64_t mr_max, mr_pairs;  // run's MRMAX and MRPAIRS: x's chunks must match (row_chunks)
};

template <typename WT, typename XT>
Kernel<WT, XT> pick_kernel() {
  const Isa isa = current_isa();  // cpuid-checked; follows set_cpu_isa
  if (isa == Isa::kAvx512) return {&run_avx512<WT>, &transpose_avx512<XT>, 16, 14};
  if (isa == Isa::kAvx2) return {&run_avx2<WT>, &transpose_avx2<XT>, 6, 0};
  return {&run_base<WT>, &transpose_base<XT>, 2, 0};
}

}  // namespace

namespace panel {

int64_t panel_bytes(Format format, int64_t K) {
  switch (format) {
    case kF32: return K * kNR * 4;
    case kBF16: return K * kNR * 2;
    case kQ4_1: return K / 32 * kQ4_1BlockBytes;
    case kQ8_0: return K / 32 * kQ8_0BlockBytes;
    case kQ4_K: return K / 256 * kQ4_KBlockBytes;
    case kQ6_K: return K / 256 * kQ6_KBlockBytes;
  }
  return -1;
}

void write_header(const at::Tensor& out, int64_t N, int64_t K, Format format) {
  const int32_t h[kHeaderBytes / 4] = {kMagic, kVersion, static_cast<int32_t>(N),
                                       static_cast<int32_t>(K), kNR,
                                       static_cast<int32_t>((N + kNR - 1) / kNR), format};
  std::memcpy(out.data_ptr(), h, sizeof h);
}

Header read_header(const at::Tensor& packed, const char* op) {
  const at::ScalarType t = packed.scalar_type();
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 1 && packed.is_contiguous() &&
                  (t == at::kFloat || t == at::kBFloat16 || t == at::kByte),
              op, ": packed must be the 1-D CPU tensor from pack_panels, pack_gguf_panels or gguf_matrix");
  const int64_t off = kHeaderBytes / static_cast<int64_t>(c10::elementSize(t));
  TORCH_CHECK(packed.numel() >= off, op, ": packed is too short for a header");
  int32_t h[kHeaderBytes / 4];
  std::memcpy(h, packed.data_ptr(), sizeof h);
  TORCH_CHECK(h[0] == kMagic && h[1] == kVersion && h[4] == kNR,
              op, ": packed has no panel header (not made by pack_panels or pack_gguf_panels, "
              "or another version)");
  const auto format = static_cast<Format>(h[6]);
  const at::ScalarType want = format == kF32 ? at::kFloat
                              : format == kBF16 ? at::kBFloat16
                              : at::kByte;
  TORCH_CHECK(format >= kF32 && format <= kQ6_K && want == t,
              op, ": packed's header names another format than its tensor's dtype");
  const Header hd{h[2], h[3], h[5], format, off};
  TORCH_CHECK(hd.N >= 1 && hd.K >= 1 &&
                  (!is_gguf_blocks(format) || hd.K % block_values(format) == 0) &&
                  hd.P == (hd.N + kNR - 1) / kNR &&
                  packed.numel() * packed.element_size() ==
                      kHeaderBytes + hd.P * panel_bytes(format, hd.K),
              op, ": packed's header does not match its size");
  return hd;
}

}  // namespace panel

template <typename T>
void fill_panels(const T* src, int64_t N, int64_t K, int64_t P, T* dst) {
  for (int64_t p = 0; p < P; ++p) {  // once per weight: a plain loop (~1 s for 425 MB)
    T* panel = dst + p * K * kNR;
    for (int j = 0; j < kNR; ++j) {
      const int64_t n = p * kNR + j;
      const T* row = src + n * K;
      if (n < N) {
        for (int64_t k = 0; k < K; ++k) panel[k * kNR + j] = row[k];
      } else {
        for (int64_t k = 0; k < K; ++k) panel[k * kNR + j] = T(0);
      }
    }
  }
}

at::Tensor panel_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_panels: weight must be a 2-D fp32 or bf16 CPU tensor [N, K], got ",
              weight.dim(), "-D ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N >= 1 && K >= 1 && N <= INT32_MAX && K <= INT32_MAX,
              "pack_panels: need 1 <= N, K < 2^31, got [", N, ", ", K, "]");
  const at::Tensor w = weight.contiguous();
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t P = (N + kNR - 1) / kNR;
  const int64_t off = panel::kHeaderBytes / static_cast<int64_t>(weight.element_size());
  at::Tensor out = at::empty({off + P * K * kNR}, weight.options());
  panel::advise_huge_pages(out.data_ptr(), out.numel() * out.element_size());
  panel::write_header(out, N, K, bf16 ? panel::kBF16 : panel::kF32);
  if (bf16) {
    fill_panels(w.data_ptr<at::BFloat16>(), N, K, P, out.data_ptr<at::BFloat16>() + off);
  } else {
    fill_panels(w.data_ptr<float>(), N, K, P, out.data_ptr<float>() + off);
  }
  return out;
}

std::vector<int64_t> panel_shape_cpu(const at::Tensor& packed) {
  if (is_gguf_matrix(packed)) return gguf_matrix_shape(packed);
  if (is_int8_matrix(packed)) return int8_matrix_shape(packed);
  const panel::Header h = panel::read_header(packed, "panel_shape");
  return {h.N, h.K};
}

namespace {

template <typename WT, typename XT>
void panel_linear_impl(const at::Tensor& x, const at::Tensor& packed, const panel::Header& h,
                       const float* b, at::Tensor& y) {
  const int64_t M = x.size(0);
  const Kernel<WT, XT> kern = pick_kernel<WT, XT>();
  const int64_t chunks = row_chunks(M, kern.mr_max, kern.mr_pairs);
  at::Tensor xt;  // one fp32 row is its own [K, 1] chunk: no copy
  thread_local std::vector<float> x_store;  // x's rows at a padded stride (decoded); reused
  const float* xp = nullptr;
  // GGUF-block panels: decoded a block at a time (run_decoded), x read by rows (below)
  const bool decoded = panel::is_gguf_blocks(h.format);
  if (!decoded && (M > 1 || !std::is_same_v<XT, float>)) {
    xt = at::empty({M * h.K}, x.options().dtype(at::kFloat));
    const int tthreads = M * h.K < kTransposeSplitElements ? 1 : at::get_num_threads();
    TaskPool::get().run(chunks, tthreads, [&](int64_t c) {
      kern.transpose(x.data_ptr<XT>(), M, h.K, c, chunks, xt.data_ptr<float>());
    });
    xp = xt.data_ptr<float>();
  } else {
    xp = reinterpret_cast<const float*>(x.data_ptr<XT>());
  }
  Args<WT> a{xp, nullptr, b, y.data_ptr<float>(), M, h.N, h.K};
  if (decoded) {
    // x's rows in place, unless at K floats apart they would fall in a few L1 sets (1B's 2048
    // and 8192): then copied at a padded stride. NOTE: only for AVX-512's chunks of 14 rows;
    // AVX2's 6 fit an 8-way set, and the copy cost them 4 % (Q4_K 2048 x 2048, 224 rows).
    a.ldx = kern.mr_max > 8 ? panel::x_row_stride(h.K) : h.K;
    if (a.ldx != h.K && M > 1) {
      x_store.resize(static_cast<size_t>(M * a.ldx));
      float* xs = x_store.data();  // the caller's: thread_local names the helper's own there
      const int cthreads = M * h.K < kTransposeSplitElements ? 1 : at::get_num_threads();
      TaskPool::get().run(chunks, cthreads, [&](int64_t c) {
        panel::copy_rows_at_stride(xp, h.K, a.ldx, M * c / chunks, M * (c + 1) / chunks, xs);
      });
      a.x = xs;
    }
    a.gguf = &h;
    a.blocks = packed.data_ptr<uint8_t>() + h.offset;
  } else {
    a.w = reinterpret_cast<const WT*>(packed.data_ptr()) + h.offset;
  }
  // One thread's time, roughly: the weight bytes at ~20 GB/s or the flops at ~80 GFLOP/s.
  const double w_bytes = static_cast<double>(h.P) * h.K * kNR * sizeof(WT);
  const double est_ns = std::max(w_bytes / 20.0, 2.0 * M * h.N * h.K / 80.0);
  const int nthreads = est_ns < panel::kInlineNs ? 1 : at::get_num_threads();
  const int64_t n = std::min(panel::pool_tasks(w_bytes, nthreads), h.P);
  // Ranges start on multiples of `align` panels, so no range leaves a short group in the middle:
  // one chunk of rows takes up to 8 panels at once (fewer: fewer FMA chains), more chunks take
  // pairs (AVX-512) or single panels. NOTE: not 8 for many rows, where a coarser start only
  // unbalances the threads: SmolLM2's 36-panel matrices split 16 | 20 and its fused k|v 8 | 16,
  // and in a classify step (8 x ~28 rows) the caller waited for the helper's larger range.
  const int64_t align = chunks > 1 ? 2 : 8;
  const auto start = [&](int64_t t) { return t == n ? h.P : h.P * t / n / align * align; };
  TaskPool::get().run(n, nthreads, [&](int64_t t) { kern.run(a, start(t), start(t + 1)); });
}

}  // namespace

at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias) {
  if (is_gguf_matrix(packed)) return gguf_matrix_linear(x, packed, bias);
  if (is_int8_matrix(packed)) return int8_matrix_linear(x, packed, bias);
  const panel::Header h = panel::read_header(packed, "panel_linear");
  // GGUF blocks hold fp32 values: x, bias and y are fp32.
  const at::ScalarType dtype = h.format == panel::kBF16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.dim() == 2,
              "panel_linear: x must be a 2-D CPU tensor [M, K] of the weight's dtype (",
              dtype, "), got ", x.dim(), "-D ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "panel_linear: x must be contiguous");
  TORCH_CHECK(x.size(1) == h.K, "panel_linear: x has K = ", x.size(1), ", the weight has K = ",
              h.K);
  at::Tensor b32;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype &&
                    bias->dim() == 1 && bias->size(0) == h.N && bias->is_contiguous(),
                "panel_linear: bias must be a contiguous CPU tensor [", h.N, "] of the weight's "
                "dtype (", dtype, ")");
    b32 = bias->to(at::kFloat);
    b = b32.data_ptr<float>();
  }
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, h.N}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(dtype);
  switch (h.format) {
    case panel::kBF16:
      panel_linear_impl<uint16_t, at::BFloat16>(x, packed, h, b, y);
      return y.to(at::kBFloat16);  // one rounding of the fp32 sums, as oneDNN's bf16 linear
    case panel::kQ4_1:
    case panel::kQ8_0:
    case panel::kQ4_K:
    case panel::kQ6_K:
      if (M <= panel::gguf_few_rows()) {
        panel::gguf_panel_linear(x, packed, h, b, y);
        return y;
      }
      break;  // many rows: the fp32 kernels over the blocks decoded (run_decoded)
    case panel::kF32:
      break;
  }
  panel_linear_impl<float, float>(x, packed, h, b, y);
  return y;
}

}  // namespace freetoken
