// What the two panel linears share (linear_cpu.cpp: fp32 / bf16 weights;
// quant_linear_cpu.cpp: GGUF Q4_1 / Q8_0 blocks): the packed tensor's header, the vector
// types of their micro-kernels, the huge-page advice.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common/isa.h"
#include "common/vec.h"

namespace freetoken {
namespace panel {

constexpr int kNR = 16;                 // panel width in weights: 16 output columns
constexpr int32_t kMagic = 0x4C505446;  // "FTPL"
constexpr int32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 64;    // so panels stay 64-byte aligned
// Header word 6: what the panels hold. fp32 / bf16 in a tensor of that dtype; GGUF blocks in a
// uint8 tensor.
enum Format : int32_t { kF32 = 0, kBF16 = 1, kQ4_1 = 2, kQ8_0 = 3, kQ4_K = 4, kQ6_K = 5 };
// GGUF blocks, regrouped per panel (csrc/linear/quant_linear_cpu.cpp): Q4_1 (32 k) as d[16], m[16]
// (the file's fp16) then the nibbles in 4 x 16 uint32 words; Q8_0 (32 k) as d[16] (fp32) then the
// int8s in 8 x 16 words; Q4_K (256 k) as d[16], dmin[16] (fp32), the 6-bit scales and mins in 4 x
// 16 words, then its 8 sub-blocks' nibbles as Q4_1's; Q6_K (256 k) as d[16] (fp32), the int8 scales
// of its 16 sub-blocks of 16 k as [16][16] bytes, then its codes less 32 as [256][16] int8. The
// blocks of each group of 4 panels interleave (quant_linear_cpu.cpp: block_index).
constexpr int64_t kQ4_1BlockBytes = 32 + 32 + 16 * 16;
constexpr int64_t kQ8_0BlockBytes = 64 + 32 * 16;
constexpr int64_t kQ4_KBlockBytes = 64 + 64 + 4 * 64 + 8 * 16 * 16;
constexpr int64_t kQ6_KBlockBytes = 64 + 4 * 64 + 256 * 16;
// k a block of `format` holds (GGUF-block formats only)
constexpr int64_t block_values(Format format) {
  return format == kQ4_K || format == kQ6_K ? 256 : 32;
}
constexpr bool is_gguf_blocks(Format format) { return format >= kQ4_1 && format <= kQ6_K; }
// GGUF-block panels: steps of at most gguf_few_rows() rows dequantize in registers per row
// chunk (quant_linear_cpu.cpp); longer ones decode each L2-sized block of panels once into fp32
// for the fp32 micro-kernels (linear_cpu.cpp run_decoded). Both give the fp32 panels' bits.
// Defined in quant_linear_cpu.cpp (it depends on the ISA variant in use).
int64_t gguf_few_rows();
// GGUF-block panels go in groups of this many whose blocks interleave (quant_linear_cpu.cpp):
// panels [p0, p1) lie within the bytes of groups p0 / kGGUFGroup .. ceil(p1 / kGGUFGroup).
constexpr int64_t kGGUFGroup = 4;
constexpr int kChains = 8;                 // independent FMA chains wanted per micro-kernel
// Panels a micro-kernel takes at once when one panel's rows hold `accumulators` vectors: a power
// of two giving at least `chains` independent FMA chains. NOTE: never the k loop: every output
// of both panel kernels is one chain over k = 0..K-1 whatever the row count (batch invariance,
// issue 23), so a row's bits do not depend on the rows beside it, and the GGUF-block panels
// give the fp32 panels' bits.
constexpr int group_panels(int accumulators, int chains) {
  int np = 1;
  while (np * accumulators < chains) np *= 2;
  return np;
}
constexpr double kTaskBytes = 512 << 10;  // the least weight bytes per pool task
// The pool tasks for a call reading `weight_bytes` on `nthreads`: contiguous ranges of at least
// kTaskBytes, up to 4 per thread (dynamic claiming absorbs a late helper), a multiple of the
// threads (3 equal tasks on 2 threads leave one idle a third of the call). NOTE: each range is a
// stream the prefetchers start cold, so small matrices take one range per thread: SmolLM2's
// one-row decode step (GGUF-block panels, Zen 4) 0.92-0.94x the time of 4 ranges per thread.
inline int64_t pool_tasks(double weight_bytes, int nthreads) {
  if (nthreads == 1) return 1;
  return std::clamp<int64_t>(static_cast<int64_t>(weight_bytes / kTaskBytes), nthreads,
                             4 * nthreads) / nthreads * nthreads;
}
// NOTE: a call estimated under this on one thread runs on the caller alone. The pool's helpers
// poll between the calls of a forward, so a split costs ~2 us, and one core does not saturate
// DRAM everywhere: on a Sapphire-Rapids-class Xeon one core streams ~11 GB/s, two ~23. At 150
// us (when a wake-up cost 10-40 us) most decode projections ran on one core: bf16 decode 1 x 1
// forward 20.9 -> 14.1 ms at 20 us, fp32 panels (linear "panels") 8 x 1 29.3 -> 22.2.
constexpr double kInlineNs = 20e3;

// x's row stride for a loop that reads its rows of x in place, side by side (the few-row loops,
// and the fp32 kernels over decoded GGUF blocks): K, or K + 16 where rows K floats apart would
// fall in at most 4 of L1's 64 sets (K * 4 bytes a multiple of 16 lines: 1536, 2048, 4096, 8192,
// 14336). There 9-16 rows' lines evicted each other (Zen 4, one thread): Q4_1 2048 x 2048 at 16
// rows took 2.0x the time of 8 rows twice; Q4_K 8192 x 2048 at 224 rows 1.38x the padded time.
inline int64_t x_row_stride(int64_t K) {
  const int64_t bytes = K * static_cast<int64_t>(sizeof(float));
  return bytes % 64 == 0 && std::gcd<int64_t>(bytes / 64, 64) >= 16 ? K + 16 : K;
}

// Rows [m0, m1) of x [M, K] (contiguous) copied to out at row stride ld.
inline void copy_rows_at_stride(const float* x, int64_t K, int64_t ld, int64_t m0, int64_t m1,
                                float* out) {
  for (int64_t m = m0; m < m1; ++m) std::memcpy(out + m * ld, x + m * K, K * sizeof(float));
}

// x [M, K] (contiguous) at row stride ld: x itself where ld == K, else its rows copied into
// `store` (the caller's, reused).
inline const float* rows_at_stride(const float* x, int64_t M, int64_t K, int64_t ld,
                                   std::vector<float>& store) {
  if (ld == K || M <= 1) return x;
  store.resize(static_cast<size_t>(M * ld));
  copy_rows_at_stride(x, K, ld, 0, M, store.data());
  return store.data();
}

struct Header {
  int64_t N, K, P;  // P = ceil(N / kNR) panels
  Format format;
  int64_t offset;  // elements of the tensor before the first panel (the header)
};

// The packed tensor's header, checked against its dtype and size; `op` names the caller in
// errors. Defined in linear_cpu.cpp.
Header read_header(const at::Tensor& packed, const char* op);
// Writes the header into the first kHeaderBytes of `out`.
void write_header(const at::Tensor& out, int64_t N, int64_t K, Format format);
// Bytes of one panel of K rows in `format`.
int64_t panel_bytes(Format format, int64_t K);

// y [M, N] (fp32, allocated) = x [M, K] fp32 @ W^T (+ bias) over GGUF-block panels (h.format
// kQ4_1 / kQ8_0 / kQ4_K / kQ6_K). Defined in quant_linear_cpu.cpp; panel_linear_cpu dispatches
// to it.
void gguf_panel_linear(const at::Tensor& x, const at::Tensor& packed, const Header& h,
                       const float* bias, at::Tensor& y);

// Panels [p0, p1) of GGUF-block panels (h.format kQ4_1 / kQ8_0 / kQ4_K / kQ6_K; `panels` = the
// first panel's first byte) decoded to their exact fp32 weights, as fp32 panels [p1 - p0][K][kNR]
// at `out`. Defined in quant_linear_cpu.cpp; linear_cpu.cpp's many-rows path runs over them.
void decode_gguf_panels(const Header& h, const uint8_t* panels, int64_t p0, int64_t p1,
                        float* out);

using vec::in_register;
using vec::loadu;
using vec::Vec;

// A micro-kernel's accumulators, acc[MR rows][V vectors of L floats], zeroed.
template <typename VF, int MR, int V>
FT_INLINE void zero(VF (&acc)[MR][V]) {
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
    for (int v = 0; v < V; ++v) acc[m][v] = VF{};
}

// The sums plus the bias, stored as columns [n0, n0 + kNR) of MR rows of y (row stride N; fewer
// past N).
template <int L, typename VF, int MR, int V>
FT_INLINE void store_sums(VF (&acc)[MR][V], float* y, int64_t N, int64_t n0, const float* bias) {
  const int64_t nv = std::min<int64_t>(kNR, N - n0);
  y += n0;
  if (nv == kNR) {
    VF b[V];
#pragma GCC unroll 64
    for (int v = 0; v < V; ++v) b[v] = bias ? loadu<L>(bias + n0 + v * L) : VF{};
#pragma GCC unroll 64
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
      for (int v = 0; v < V; ++v) {
        const VF o = acc[m][v] + b[v];
        std::memcpy(y + m * N + v * L, &o, sizeof o);
      }
  } else {  // the tail panel: only nv columns exist
    for (int m = 0; m < MR; ++m)
      for (int64_t j = 0; j < nv; ++j)
        y[m * N + j] = acc[m][j / L][j % L] + (bias ? bias[n0 + j] : 0.f);
  }
}

// NOTE: a decode step streams every weight from DRAM; with 4 KB pages that is a TLB miss per 64
// lines, and cold reads here ran ~20% faster from 2 MB pages (what THP_MEM_ALLOC_ENABLE=1 does
// for every torch allocation). Asked for before the first touch, the packing writes fault huge
// pages in; a no-op where THP is off or the range is smaller than one huge page.
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace panel
}  // namespace freetoken
