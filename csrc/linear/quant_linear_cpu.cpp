// The panel linear over GGUF blocks: y [M, N] = x [M, K] @ W^T (+ bias) in fp32, where W stays in
// the GGUF file's Q4_1, Q8_0, Q4_K or Q6_K blocks and each weight is dequantized in registers to
// exactly the fp32 value the loader's dequantization gives (freetoken/loader/gguf.py,
// gguf.quants).
//
// Why: a decode step reads every weight once. SmolLM2's fp32 weights are 425 MB per step of
// layers, read at ~25 GB/s here: ~18 ms a step whatever the row count up to ~8. The same weights
// as Q4_1 blocks are 66 MB, and dequantizing them costs ~4 vector ops per 16 weights, shared by
// every row of the step. The results are the fp32 model's: no activation is quantized, no product
// is rounded differently from the fp32 kernel's.
//
// Exactness: Q4_1 is w = d * q + m with d, m fp16 and q in 0..15, Q8_0 is w = d * q with q int8.
// d * q needs at most 11 + 8 significant bits, so it is exact in fp32, and fma(q, d, m) rounds
// once, as gguf's `(d * qs) + m` in numpy float32 does: the same fp32 weight, bit for bit. Q4_K
// is Q4_1 per sub-block of 32 once its scales are expanded (expand_k_scales); Q6_K is Q8_0 per
// sub-block of 16, its q the code less 32 and its d gguf's d * sc (expand_k6_scales): d * sc
// holds at most 11 + 8 significant bits and q at most 6, so both products are exact.
//
// Layout: panels of 16 output columns, as the fp32 panels (linear_cpu.cpp), each cut into blocks of
// 32 k: Q4_1: d[16], m[16] fp16 (the file's, made fp32 once a block: 0.625 bytes a weight, as the
// file, where fp32 scales made 0.75), then 4 x 16 uint32 words, word [g][j] holding column j's q of
// rows 8 g + t in bits 4 t .. 4 t + 3; Q8_0: d[16] fp32, then 8 x 16 words, [g][j] holding the int8
// q of rows 4 g + t in bits 8 t .. 8 t + 7; Q4_K (blocks of 256 k): d[16], dmin[16] fp32, 4 x 16
// words of scales and mins (two sub-blocks' 6-bit sc | m << 8 each), then the 8 sub-blocks' words
// as Q4_1's; Q6_K (blocks of 256 k): d[16] fp32, the 16 sub-blocks' int8 scales as [16][16] bytes,
// then the codes less 32 as int8, [256][16] bytes. A row is then a shift and a mask (Q8_0: two
// shifts, the second arithmetic) of one 64-byte vector, in 32-bit lanes on every ISA (Q6_K: one
// sign-extending load of its 16 bytes, byte_row). The blocks of each group of 4 panels interleave,
// block by block (block_index), so the kernel reads a group as one stream.
//
// Steps of more than gguf_few_rows() rows do not come here: linear_cpu.cpp decodes a block of
// panels at a time into fp32 (decode_gguf_panels, below) and runs the fp32 panels' micro-kernels
// on it.
//
// Micro-kernel: as the fp32 panels': MR rows of x (read in place), MR x 16 accumulators a panel,
// up to 4 panels at once for small MR (for 8 FMA chains, as the fp32 panels), or on AVX2 one
// half panel at a time (gguf_half_panels); per block row the dequantized vector is shared by the
// MR FMAs. Every output is one FMA chain over k = 0..K-1 then + bias, the fp32 panels' order:
// these give their bits, whatever the row count (batch invariance). Threads: panel ranges over
// the TaskPool, small calls on the caller.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "common/isa.h"
#include "common/task_pool.h"
#include "linear/gguf_blocks.h"
#include "linear/panel_common.h"

namespace freetoken {

using panel::Format;
using panel::in_register;
using panel::kNR;
using panel::kQ4_1BlockBytes;
using panel::kQ4_KBlockBytes;
using panel::kQ6_KBlockBytes;
using panel::kQ8_0BlockBytes;
using panel::loadu;
using panel::Vec;

namespace {

// A GGUF block's bytes: Q4_1 fp16 d, m and 16 bytes of nibbles; Q8_0 fp16 d and 32 int8; Q4_K
// fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles; Q6_K 128 bytes of the codes'
// low nibbles, 64 of their high 2 bits, 16 int8 scales, fp16 d.
constexpr int64_t source_bytes(Format f) {
  return f == panel::kQ4_1 ? 20 : f == panel::kQ8_0 ? 34 : f == panel::kQ4_K ? 144 : 210;
}

// fn.template operator()<F>() for the GGUF-block format f: one instantiation per format.
template <typename Fn>
decltype(auto) with_format(Format f, Fn&& fn) {
  switch (f) {
    case panel::kQ4_1: return fn.template operator()<panel::kQ4_1>();
    case panel::kQ8_0: return fn.template operator()<panel::kQ8_0>();
    case panel::kQ4_K: return fn.template operator()<panel::kQ4_K>();
    default: return fn.template operator()<panel::kQ6_K>();
  }
}

constexpr int64_t kBlockPanelsBytes = 128 << 10;  // panels walked per row chunk when M > MR_max
// NOTE: the blocks are asked for this far ahead of the FMAs, into L2 (prefetcht1): a decode step
// reads every layer's blocks from DRAM once, and the hardware prefetchers alone left the kernel
// waiting on them (a Xeon, SmolLM2 in the forward at 8 rows: gate_up 200 -> 165 us, the whole
// decode step of 8 ~10 % faster; 768 to 6144 bytes ahead all help alike). Into L2, not L1: on
// Zen 4 requests into L1 bought nothing (the one-row step 7.7-8.1 ms, as with none), into L2
// SmolLM2's one-row step took 5.5-5.8 ms, 8 rows level; the fp32 panels and attention prefetch
// into L2 too. The requests go out a few lines at a time as the block is consumed (GroupBlocks::
// prefetch_part), not as one burst a block: a K-quant group's block row is 152 (Q4_K) or 276
// (Q6_K) lines, and asking for them at once stalled the FMAs behind the line-fill buffers (1B
// file, 8 layers' Q4_K: one row 24-26 -> 16-17 ms, 8 rows 44-46 -> 36-37; without any software
// prefetch 22-24 and 41-43). A 32-value format's 6-9 lines go at once: spread, SmolLM2's Q8_0
// lm_head and Q4_1 gate|up read 1.01-1.03x the time. Q8_0 asks 8192 bytes ahead (15 blocks of a
// panel, ~35 KB of the stream, not 3): SmolLM2's one-row step, where Q8_0 is the 28 MB lm_head,
// took 0.95-0.98x the time (8 rows 0.99x); the same distance for every format cost that step
// 1.05-1.4x (fresh processes), its Q4_1 matrices' ranges being 30-140 KB (Zen 4, 2 threads).
constexpr int64_t kPrefetchBytes = 1536;
constexpr int64_t prefetch_bytes(Format f) { return f == panel::kQ8_0 ? 8192 : kPrefetchBytes; }
// NOTE: dequantizing makes these calls compute bound, so they scale with threads; as for the
// fp32 panels (panel::kInlineNs) only calls estimated under this stay on the caller.
constexpr double kSplitNs = panel::kInlineNs;

// Panels go in groups of kGroup whose blocks interleave, [block b][panel j of the group]: the
// few-row kernel takes a group's panels at once (for its FMA chains), and so reads one stream,
// as one panel at a time did. NOTE: four panels' blocks side by side cost one row cold reads
// from four streams: the bare decode 1 x 1 forward at one thread 3.6-4.2 -> 5.6-6.3 ms.
constexpr int64_t kGroup = panel::kGGUFGroup;

// Where block b of panel p starts, in blocks (P panels of nb blocks).
FT_INLINE int64_t block_index(int64_t p, int64_t b, int64_t nb, int64_t P) {
  const int64_t g0 = p / kGroup * kGroup, gs = std::min(kGroup, P - g0);
  return g0 * nb + b * gs + (p - g0);
}

struct Args {
  const float* x;     // [M, K] at row stride ldx (in place, or padded: panel::x_row_stride)
  const uint8_t* w;   // panels
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t M, N, K, ldx;
};

// A format's panel blocks: kValues k each, in sub-blocks of kSubValues k whose weights are
// q * d + m (int8 codes: q * d), their codes packed kRows k to a 32-bit word (kByteRows: as
// [k][16] bytes, taken kRows rows at a time).
template <Format F>
struct Layout {
  static constexpr bool kNibbles = F == panel::kQ4_1 || F == panel::kQ4_K;  // else int8 codes
  static constexpr bool kByteRows = F == panel::kQ6_K;
  static constexpr int kRows = kNibbles ? 8 : 4;
  static constexpr int64_t kValues = panel::block_values(F);
  static constexpr int kSubValues = F == panel::kQ6_K ? 16 : 32;
  static constexpr int kSubs = static_cast<int>(kValues / kSubValues);
  static constexpr int64_t kBytes = F == panel::kQ4_1   ? kQ4_1BlockBytes
                                    : F == panel::kQ8_0 ? kQ8_0BlockBytes
                                    : F == panel::kQ4_K ? kQ4_KBlockBytes
                                                        : kQ6_KBlockBytes;
  // sub-block s's kSubValues / kRows x 16 words in a block
  static FT_INLINE const uint8_t* words(const uint8_t* block, int s) {
    return block + (F == panel::kQ4_1   ? 64
                    : F == panel::kQ8_0 ? 64
                    : F == panel::kQ4_K ? 384 + s * 256
                                        : 320 + s * 256);
  }
};

// float(w & 15) in each lane. On 16 lanes it is one vpermps from the table 0..15, which reads
// only an index's low 4 bits: no mask and no convert (__builtin_shuffle takes its indices
// modulo the lane count).
template <int L>
FT_INLINE typename Vec<L>::f nibble(typename Vec<L>::u w) {
  using vf = typename Vec<L>::f;
  using vi = typename Vec<L>::i;
  if constexpr (L == 16) {
    const vf table = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f,
                      8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f};
    return __builtin_shuffle(table, vi(w));
  } else {
    return __builtin_convertvector(vi(w & 15u), vf);
  }
}

// Row t of a group of packed words as fp32 weights (module comment: the layout). Q4_1, Q4_K: the
// nibble at bits 4 t, times d, plus m. Q8_0: the byte at bits 8 t moved to the top, then an
// arithmetic shift down, times d.
template <int L, Format F>
FT_INLINE typename Vec<L>::f weight_row(typename Vec<L>::u word, int t, typename Vec<L>::f d,
                                        typename Vec<L>::f m) {
  using vf = typename Vec<L>::f;
  using vi = typename Vec<L>::i;
  if constexpr (Layout<F>::kNibbles) {
    return nibble<L>(word >> (4 * t)) * d + m;
  } else {
    (void)m;
    return __builtin_convertvector(vi(word << (24 - 8 * t)) >> 24, vf) * d;
  }
}

// L int8 at p as fp32 lanes. NOTE: one vpmovsxbd (inline asm: GCC 12 scalarizes a widening
// __builtin_convertvector from int8 lanes), where taking a byte of 32-bit words costs two
// shifts: on AVX-512 the shifts and the convert all wait for port 0. The bytes come in by a
// plain load: with a memory operand GCC kept the accumulators in memory around the asm.
template <int L>
FT_INLINE typename Vec<L>::f byte_row(const uint8_t* p) {
  using vi = typename Vec<L>::i;
  typedef int8_t bytes __attribute__((vector_size(16)));
  vi q;
  if constexpr (L == 16 || L == 8) {
    bytes b{};
    std::memcpy(&b, p, L);
    if constexpr (L == 16)
      asm("vpmovsxbd %1, %0" : "=v"(q) : "x"(b));
    else
      asm("vpmovsxbd %1, %0" : "=x"(q) : "x"(b));
  } else {
#pragma GCC unroll 16
    for (int l = 0; l < L; ++l) q[l] = static_cast<int8_t>(p[l]);
  }
  return __builtin_convertvector(q, typename Vec<L>::f);
}

// Row r of a sub-block's codes at q, lanes [v L, v L + L), as fp32 weights: from `word` (its
// rows' 32-bit words, weight_row) or, for kByteRows, from the row's bytes.
template <int L, Format F>
FT_INLINE typename Vec<L>::f row_weights(const uint8_t* q, typename Vec<L>::u word, int r, int v,
                                         typename Vec<L>::f d, typename Vec<L>::f m) {
  if constexpr (Layout<F>::kByteRows) {
    (void)word;
    (void)m;
    return byte_row<L>(q + r * kNR + v * L) * d;
  } else {
    (void)q;
    (void)v;
    return weight_row<L, F>(word, r % Layout<F>::kRows, d, m);
  }
}

// L fp16 at p as fp32 lanes (exact): one vcvtph2ps (inline asm, as byte_row's vpmovsxbd).
template <int L>
FT_INLINE typename Vec<L>::f halves(const uint8_t* p) {
  typename Vec<L>::f f;
  if constexpr (L == 16 || L == 8) {
    typedef uint16_t h16 __attribute__((vector_size(2 * L)));
    h16 h;
    std::memcpy(&h, p, sizeof h);
    if constexpr (L == 16)
      asm("vcvtph2ps %1, %0" : "=v"(f) : "x"(h));
    else
      asm("vcvtph2ps %1, %0" : "=x"(f) : "x"(h));
  } else {
#pragma GCC unroll 16
    for (int l = 0; l < L; ++l) {
      c10::Half h;
      std::memcpy(&h, p + 2 * l, sizeof h);
      f[l] = static_cast<float>(h);
    }
  }
  return f;
}

// Q4_1: a block's d[16], m[16] (fp16) as fp32 at out, lanes [v0 L, v1 L) of each only: once a
// block, where the kernels read them once a word group.
template <int L>
FT_INLINE void expand_halves(const uint8_t* block, float* out, int v0, int v1) {
  using vf = typename Vec<L>::f;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
    for (int v = v0; v < v1; ++v) {
      const vf f = halves<L>(block + (h * kNR + v * L) * 2);
      std::memcpy(out + h * kNR + v * L, &f, sizeof f);
    }
  }
}

// Q4_K: a block's 8 sub-blocks' scales as [d * sc[16], -dmin * m[16]] each at out, so that
// weight_row's q * d + m is gguf's (d * sc) * q - dmin * m: d * sc and dmin * m are exact
// (11 x 6 significant bits), and so is their product with q, so both round once, at the end.
// Only lanes [v0 L, v1 L) are written (a half panel reads its own half).
template <int L>
FT_INLINE void expand_k_scales(const uint8_t* block, float* out, int v0, int v1) {
  using vf = typename Vec<L>::f;
  using vu = typename Vec<L>::u;
  using vi = typename Vec<L>::i;
  const float* d = reinterpret_cast<const float*>(block);
  const uint8_t* words = block + 2 * kNR * 4;  // [s / 2][16]: sc, m of s even, then of s odd
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    const unsigned shift = 16 * (s & 1);
#pragma GCC unroll 4
    for (int v = v0; v < v1; ++v) {
      vu w;
      std::memcpy(&w, words + ((s / 2) * kNR + v * L) * 4, sizeof w);
      const vf sc = __builtin_convertvector(vi((w >> shift) & 255u), vf);
      const vf mn = __builtin_convertvector(vi((w >> (shift + 8)) & 255u), vf);
      const vf ds = loadu<L>(d + v * L) * sc, dm = -(loadu<L>(d + kNR + v * L) * mn);
      std::memcpy(out + s * 32 + v * L, &ds, sizeof ds);
      std::memcpy(out + s * 32 + kNR + v * L, &dm, sizeof dm);
    }
  }
}

// Q6_K: a block's 16 sub-blocks' d * sc[16] at out (gguf's d * scales: 11 x 8 significant
// bits, exact, and so is its product with a code less 32), lanes [v0 L, v1 L) only.
template <int L>
FT_INLINE void expand_k6_scales(const uint8_t* block, float* out, int v0, int v1) {
  using vf = typename Vec<L>::f;
  const float* d = reinterpret_cast<const float*>(block);
  const uint8_t* sc = block + kNR * 4;  // [16 sub-blocks][16] int8
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {
#pragma GCC unroll 4
    for (int v = v0; v < v1; ++v) {
      const vf ds = loadu<L>(d + v * L) * byte_row<L>(sc + s * kNR + v * L);
      std::memcpy(out + s * kNR + v * L, &ds, sizeof ds);
    }
  }
}

// The [d[16], m[16]] of sub-block s of a block of panel j of NP (int8 codes: d[16] alone): the
// block's own (Q8_0), or those expand_halves / expand_k_scales / expand_k6_scales made once per
// block (Q4_1 / Q4_K / Q6_K; at(j): panel j's block; lanes [v0 L, v1 L) of each, all by
// default).
template <int L, int NP, Format F>
struct BlockScales {
  static constexpr bool kExpanded = F != panel::kQ8_0;
  static constexpr int kPerSub = F == panel::kQ4_K || F == panel::kQ4_1 ? 2 * kNR : kNR;
  static constexpr int kPerBlock = Layout<F>::kSubs * kPerSub;
  alignas(64) float expanded[kExpanded ? NP * kPerBlock : 1];
  template <typename At>
  FT_INLINE explicit BlockScales(const At& at, int v0 = 0, int v1 = kNR / L) {
    if constexpr (F == panel::kQ4_K) {
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) expand_k_scales<L>(at(j), expanded + j * kPerBlock, v0, v1);
    } else if constexpr (F == panel::kQ6_K) {
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) expand_k6_scales<L>(at(j), expanded + j * kPerBlock, v0, v1);
    } else if constexpr (F == panel::kQ4_1) {
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) expand_halves<L>(at(j), expanded + j * kPerBlock, v0, v1);
    } else {
      (void)at;
      (void)v0;
      (void)v1;
    }
  }
  FT_INLINE const float* of(const uint8_t* block, int j, int s) const {
    if constexpr (kExpanded) {
      (void)block;
      return expanded + j * kPerBlock + s * kPerSub;
    } else {
      (void)j;
      (void)s;
      return reinterpret_cast<const float*>(block);
    }
  }
};

// The blocks of panels p .. p + NP - 1, one group's (NP divides kGroup and p is a multiple of
// NP): block b of panel p + j at at(j, b).
template <int NP, Format F>
struct GroupBlocks {
  static constexpr int64_t kBlock = Layout<F>::kBytes;
  static constexpr int64_t kAheadBlocks = (prefetch_bytes(F) + kBlock - 1) / kBlock;  // a panel's
  const uint8_t* first[NP];
  int64_t stride;  // one block on
  FT_INLINE GroupBlocks(const Args& a, int64_t p) {
    const int64_t nb = a.K / Layout<F>::kValues, P = (a.N + kNR - 1) / kNR;
    stride = std::min(kGroup, P - p / kGroup * kGroup) * kBlock;
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) first[j] = a.w + block_index(p + j, 0, nb, P) * kBlock;
  }
  FT_INLINE const uint8_t* at(int j, int64_t b) const { return first[j] + b * stride; }
  // The parts a block's prefetches are spread over: one per word group (the kernels' iterations
  // over a block) for the K-quants, else one.
  static constexpr int kGroups = Layout<F>::kSubs * (Layout<F>::kSubValues / Layout<F>::kRows);
  static constexpr int kParts = Layout<F>::kValues > 32 ? kGroups : 1;
  // Asks for part `part` (a block's word group) of the lines of every panel's block
  // prefetch_bytes(F) ahead of block b: each group takes its share, so the requests follow the
  // reads.
  FT_INLINE void prefetch_part(int64_t b, int part) const {
    if (part >= kParts) return;
    constexpr int64_t kLines = (kBlock + 63) / 64;
    const int64_t l0 = part * kLines / kParts, l1 = (part + 1) * kLines / kParts;
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const uint8_t* ahead = at(j, b + kAheadBlocks);
      for (int64_t l = l0; l < l1; ++l) __builtin_prefetch(ahead + 64 * l, 0, 2);
    }
  }
};

// Rows [r0, r0 + MR) of y (xr: their pointers), panels [p, p + NP). L = floats per vector.
template <int L, int MR, int NP, Format F>
FT_INLINE void gguf_group(const Args& a, const float* const (&xr)[MR], int64_t r0, int64_t p) {
  using vf = typename Vec<L>::f;
  // NOTE: the blocks are read as 32-bit lanes only: GCC 12 scalarizes a widening
  // __builtin_convertvector from uint8 lanes (a movzbl + vpinsrd per byte), and intrinsics
  // cannot serve the three ISA variants of one template.
  using vu = typename Vec<L>::u;
  using Lay = Layout<F>;
  constexpr int V = kNR / L;
  constexpr int kRows = Lay::kRows;  // rows packed in a word
  const int64_t nb = a.K / Lay::kValues;
  const GroupBlocks<NP, F> blk(a, p);
  vf acc[NP][MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) panel::zero(acc[j]);
  constexpr int G = Lay::kSubValues / kRows;  // word groups a sub-block
  for (int64_t b = 0; b < nb; ++b) {
    const BlockScales<L, NP, F> scales([&](int j) { return blk.at(j, b); });
    for (int s = 0; s < Lay::kSubs; ++s)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {  // rows kRows g .. kRows (g + 1) - 1
      blk.prefetch_part(b, s * G + g);
      // NOTE: panel by panel: a panel's scales and words are live only for its own rows (8
      // panels' at once spilled at one row); the out-of-order core overlaps the panels' chains
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        const uint8_t* bj = blk.at(j, b);
        const float* dp = scales.of(bj, j, s);
        const uint8_t* q = Lay::words(bj, s);
        vf d[V], mn[V];
        vu words[V];
#pragma GCC unroll 64
        for (int v = 0; v < V; ++v) {
          d[v] = loadu<L>(dp + v * L);
          mn[v] = Lay::kNibbles ? loadu<L>(dp + kNR + v * L) : vf{};
          if constexpr (!Lay::kByteRows)
            std::memcpy(&words[v], q + (g * kNR + v * L) * 4, sizeof(vu));
        }
#pragma GCC unroll 8
        for (int t = 0; t < kRows; ++t) {
          const int64_t k = b * Lay::kValues + s * Lay::kSubValues + kRows * g + t;
          vf w[V];
#pragma GCC unroll 64
          for (int v = 0; v < V; ++v)
            w[v] = in_register(row_weights<L, F>(q, words[v], g * kRows + t, v, d[v], mn[v]));
#pragma GCC unroll 64
          for (int m = 0; m < MR; ++m) {
            const float xs = xr[m][k];
#pragma GCC unroll 64
            for (int v = 0; v < V; ++v) acc[j][m][v] += w[v] * xs;
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j)
    panel::store_sums<L>(acc[j], a.y + r0 * a.N, a.N, (p + j) * kNR, a.bias);
}

// AVX2: panels p .. p + NP - 1 one 8-output half at a time (NP x MR accumulators, where whole
// panels would take twice as many of the 16 registers), so that 3-8 rows decode each weight
// once (in 3-row chunks, once a chunk) and Q4_1's one or two rows, 4 panels at once, do not
// spill. The second half reads the panels from L1 or L2. Each output's chain over k is
// gguf_group's: the same bits. NOTE: Zen 3, 1536 x 576 from DRAM, time against gguf_group:
// Q4_1 1 row 0.61-0.90x, 2 rows 0.80-0.85x, 3 rows 0.61-0.68x, 4 rows 0.28-0.51x, 8 rows
// 0.62-0.70x, 16 rows 0.72-0.78x. Q8_0 (no min to keep) at 1 row 1.06-1.15x, and its 49152-row
// lm_head 1.28-1.36x, so Q8_0 keeps gguf_group below 3 rows.
template <int L, int MR, int NP, Format F>
FT_INLINE void gguf_half_panels(const Args& a, const float* const (&xr)[MR], int64_t r0,
                                int64_t p) {
  using vf = typename Vec<L>::f;
  using vu = typename Vec<L>::u;
  using Lay = Layout<F>;
  constexpr int V = kNR / L;
  constexpr int kRows = Lay::kRows;
  const int64_t nb = a.K / Lay::kValues;
  const GroupBlocks<NP, F> blk(a, p);
  vf sums[NP][MR][V];
#pragma GCC unroll 2
  for (int h = 0; h < V; ++h) {
    vf acc[NP][MR];
    panel::zero(acc);
    constexpr int G = Lay::kSubValues / kRows;
    for (int64_t b = 0; b < nb; ++b) {
      const BlockScales<L, NP, F> scales([&](int j) { return blk.at(j, b); }, h, h + 1);
      for (int s = 0; s < Lay::kSubs; ++s)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        // the second half finds the blocks in L1 or L2
        if (h == 0) blk.prefetch_part(b, s * G + g);
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
          const uint8_t* bj = blk.at(j, b);
          const float* dp = scales.of(bj, j, s);
          const uint8_t* q = Lay::words(bj, s);
          const vf d = loadu<L>(dp + h * L);
          const vf mn = Lay::kNibbles ? loadu<L>(dp + kNR + h * L) : vf{};
          vu words{};
          if constexpr (!Lay::kByteRows)
            std::memcpy(&words, q + (g * kNR + h * L) * 4, sizeof(vu));
#pragma GCC unroll 8
          for (int t = 0; t < kRows; ++t) {
            const int64_t k = b * Lay::kValues + s * Lay::kSubValues + kRows * g + t;
            const vf w = in_register(row_weights<L, F>(q, words, g * kRows + t, h, d, mn));
#pragma GCC unroll 16
            for (int m = 0; m < MR; ++m) acc[j][m] += w * xr[m][k];
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) sums[j][m][h] = acc[j][m];
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j)
    panel::store_sums<L>(sums[j], a.y + r0 * a.N, a.N, (p + j) * kNR, a.bias);
}

// Panels [p0, p1) by gguf_half_panels in groups of NP, then the rest in halving groups.
template <int L, int MR, int NP, Format F>
FT_INLINE void gguf_half_groups(const Args& a, const float* const (&xr)[MR], int64_t r0,
                                int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) gguf_half_panels<L, MR, NP, F>(a, xr, r0, p);
  if constexpr (NP > 1) {
    if (p < p1) gguf_half_groups<L, MR, NP / 2, F>(a, xr, r0, p, p1);
  }
}

// Panels [p0, p1) in groups of NP, then the rest in halving groups.
template <int L, int MR, int NP, Format F>
FT_INLINE void gguf_groups(const Args& a, const float* const (&xr)[MR], int64_t r0, int64_t p0,
                           int64_t p1) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) gguf_group<L, MR, NP, F>(a, xr, r0, p);
  if constexpr (NP > 1) {
    if (p < p1) gguf_groups<L, MR, NP / 2, F>(a, xr, r0, p, p1);
  }
}

// Rows [r0, r0 + MR) of y, panels [p0, p1).
template <int L, int MR, Format F>
FT_INLINE void gguf_panels(const Args& a, int64_t r0, int64_t p0, int64_t p1) {
  const float* xr[MR];  // the chunk's rows
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m) xr[m] = a.x + (r0 + m) * a.ldx;
  if constexpr (L == 8 && (MR >= 3 || Layout<F>::kNibbles)) {
    constexpr int HNP = MR <= 2 ? 4 : 1;  // 2 or 4 panels at 3-4 rows: 1.24-1.8x the time
    gguf_half_groups<L, MR, HNP, F>(a, xr, r0, p0, p1);
  } else {
    // NOTE: 8 chains as the fp32 panels, but at most 4 panels at once: at one row, 8 panels'
    // blocks in flight cost the lm_head (49152 x 576 Q8_0) 1.10 -> 1.69 ms (8 streams), while 2
    // and 4 rows need the 8 chains (Q4_1 1536 x 576 at 4 rows: 57 -> 42 us). From 5 rows one
    // panel: its 5-7 chains keep the FMAs busy, where two panels' 10-14 accumulators and their
    // blocks' vectors spilled (Zen 4, one thread: Q4_1 1536 x 576 at 6 rows 0.180 -> 0.109 ms,
    // Q4_K 2048 x 2048 0.944 -> 0.514; 3 rows on two panels instead of four: 1.08x the time).
    constexpr int NP = MR >= 5 ? 1 : std::min(4, panel::group_panels(MR * (kNR / L),
                                                                     panel::kChains));
    gguf_groups<L, MR, NP, F>(a, xr, r0, p0, p1);
  }
}

// MR from the run-time row count mr (1..MR): one instantiation per value.
template <int L, int MR, Format F>
FT_INLINE void gguf_panels_rows(const Args& a, int mr, int64_t r0, int64_t p0, int64_t p1) {
  if constexpr (MR > 1) {
    if (mr < MR) return gguf_panels_rows<L, MR - 1, F>(a, mr, r0, p0, p1);
  }
  gguf_panels<L, MR, F>(a, r0, p0, p1);
}

// Panels [p0, p1) for every row: rows in equal chunks of at most MRMAX, each chunk walking an
// L2-sized range of panels (the blocks then come from DRAM once).
template <int L, int MRMAX, Format F>
FT_INLINE void run(const Args& a, int64_t p0, int64_t p1) {
  const int64_t chunks = (a.M + MRMAX - 1) / MRMAX;
  // whole groups a walk (p0 is a multiple of kGroup: the thread ranges start on one)
  const int64_t block = chunks == 1 ? p1 - p0 : std::max<int64_t>(
      kGroup, kBlockPanelsBytes / panel::panel_bytes(F, a.K) / kGroup * kGroup);
  for (int64_t b0 = p0; b0 < p1; b0 += block) {
    const int64_t b1 = std::min(p1, b0 + block);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = a.M * c / chunks, r1 = a.M * (c + 1) / chunks;
      gguf_panels_rows<L, MRMAX, F>(a, static_cast<int>(r1 - r0), r0, b0, b1);
    }
  }
}

// Panels [p0, p1) decoded to their fp32 weights in the fp32 panels' layout ([K, 16] each, panel
// p0 first): the many-rows path of linear_cpu.cpp runs the fp32 micro-kernels over them.
template <int L, Format F>
FT_INLINE void decode(const uint8_t* w, int64_t N, int64_t K, int64_t p0, int64_t p1, float* out) {
  using vf = typename Vec<L>::f;
  using vu = typename Vec<L>::u;
  using Lay = Layout<F>;
  constexpr int V = kNR / L;
  constexpr int kRows = Lay::kRows;
  const int64_t nb = K / Lay::kValues, P = (N + kNR - 1) / kNR;
  // In the order the blocks lie (a group's blocks interleave, block_index): one forward stream.
  for (int64_t g0 = p0 / kGroup * kGroup; g0 < p1; g0 += kGroup) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t p = std::max(g0, p0); p < std::min({g0 + kGroup, p1, P}); ++p) {
        float* o = out + (p - p0) * K * kNR;
        const uint8_t* bj = w + block_index(p, b, nb, P) * Lay::kBytes;
        const BlockScales<L, 1, F> scales([&](int) { return bj; });
        for (int s = 0; s < Lay::kSubs; ++s) {
          const float* dp = scales.of(bj, 0, s);
          const uint8_t* q = Lay::words(bj, s);
          vf d[V], mn[V];
#pragma GCC unroll 64
          for (int v = 0; v < V; ++v) {
            d[v] = loadu<L>(dp + v * L);
            mn[v] = Lay::kNibbles ? loadu<L>(dp + kNR + v * L) : vf{};
          }
#pragma GCC unroll 8
          for (int g = 0; g < Lay::kSubValues / kRows; ++g) {
            vu words[V]{};
#pragma GCC unroll 64
            for (int v = 0; v < V; ++v)
              if constexpr (!Lay::kByteRows)
                std::memcpy(&words[v], q + (g * kNR + v * L) * 4, sizeof(vu));
#pragma GCC unroll 8
            for (int t = 0; t < kRows; ++t)
#pragma GCC unroll 64
              for (int v = 0; v < V; ++v) {
                const vf r = row_weights<L, F>(q, words[v], g * kRows + t, v, d[v], mn[v]);
                const int64_t k = b * Lay::kValues + s * Lay::kSubValues + kRows * g + t;
                std::memcpy(o + k * kNR + v * L, &r, sizeof r);
              }
          }
        }
      }
    }
  }
}

template <Format F>
FT_TARGET_AVX512 void decode_avx512(const uint8_t* w, int64_t N, int64_t K, int64_t p0,
                                    int64_t p1, float* out) {
  decode<16, F>(w, N, K, p0, p1, out);
}
template <Format F>
FT_TARGET_AVX2 void decode_avx2(const uint8_t* w, int64_t N, int64_t K, int64_t p0, int64_t p1,
                                float* out) {
  decode<8, F>(w, N, K, p0, p1, out);
}
template <Format F>
void decode_base(const uint8_t* w, int64_t N, int64_t K, int64_t p0, int64_t p1, float* out) {
  decode<4, F>(w, N, K, p0, p1, out);
}

template <Format F>
void decode_any(const uint8_t* w, int64_t N, int64_t K, int64_t p0, int64_t p1, float* out) {
  const Isa isa = current_isa();
  if (isa == Isa::kAvx512) return decode_avx512<F>(w, N, K, p0, p1, out);
  if (isa == Isa::kAvx2) return decode_avx2<F>(w, N, K, p0, p1, out);
  decode_base<F>(w, N, K, p0, p1, out);
}

// Registers: AVX-512 holds 16 rows' accumulators and the block's vectors in its 32 (one panel
// at a time from 8 rows: 8 chains); AVX2 the 1-7 rows of its steps (gguf_few_rows) in one chunk
// by half panels (Q8_0's 1-2 rows: 2 rows in 16; 8 rows' half panels took 1.5x 7 rows' time);
// SSE2 (four vectors a panel row) 1.
// NOTE: 16 rows, not 8: 9-16 rows in one chunk dequantize each block once, not twice
// (SmolLM2's layer linears at 12 rows: 13.7 -> 7.7 ms, 16 rows: 13.4 -> 9.9). Steps of at most
// 8 rows (decode) keep a function of their own, the code they had before.
template <Format F>
FT_TARGET_AVX512 void run_avx512(const Args& a, int64_t p0, int64_t p1) {
  run<16, 8, F>(a, p0, p1);
}
template <Format F>
FT_TARGET_AVX512 void run_avx512_16(const Args& a, int64_t p0, int64_t p1) {
  run<16, 16, F>(a, p0, p1);
}
template <Format F>
FT_TARGET_AVX2 void run_avx2(const Args& a, int64_t p0, int64_t p1) {
  run<8, 7, F>(a, p0, p1);
}
template <Format F>
void run_base(const Args& a, int64_t p0, int64_t p1) {
  run<4, 1, F>(a, p0, p1);
}

struct Kernel {
  void (*run)(const Args&, int64_t, int64_t);
  int64_t mr_max;
};

template <Format F>
Kernel pick_kernel(int64_t M) {
  const Isa isa = current_isa();  // cpuid-checked; follows set_cpu_isa
  if (isa == Isa::kAvx512)
    return M <= 8 ? Kernel{&run_avx512<F>, 8} : Kernel{&run_avx512_16<F>, 16};
  if (isa == Isa::kAvx2) return {&run_avx2<F>, 7};
  return {&run_base<F>, 1};
}

float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);  // exact
}

// Unmaps the whole pages of [lo, hi) from the process (a read-only file mapping: they refault
// from the page cache if read again).
void release_pages(const uint8_t* lo, const uint8_t* hi) {
#if defined(__linux__)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = (reinterpret_cast<uintptr_t>(lo) + page - 1) & ~(page - 1);
  const uintptr_t b = reinterpret_cast<uintptr_t>(hi) & ~(page - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
#else
  (void)lo;
  (void)hi;
#endif
}

// The low (or high) nibbles of the 8 bytes at p as one word, byte t's at bits 4 t: a panels'
// word of 8 rows. NOTE: a word at a time, where a loop of 32 nibbles per word took the 8B
// file's packing ~20 s.
FT_INLINE uint32_t nibble_word(const uint8_t* p, bool high) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  x = (high ? x >> 4 : x) & 0x0F0F0F0F0F0F0F0FULL;
  x = (x | x >> 4) & 0x00FF00FF00FF00FFULL;  // nibble pairs in bytes 0, 2, 4, 6
  x = (x | x >> 8) & 0x0000FFFF0000FFFFULL;
  return static_cast<uint32_t>(x | x >> 16);
}

// GGUF row j's block at `s` into panel block `out` (module comment: the layout), by format.
void fill_q4_1(const uint8_t* s, int j, uint8_t* out) {
  std::memcpy(out + 2 * j, s, 2);              // d
  std::memcpy(out + 2 * (kNR + j), s + 2, 2);  // m
  const uint8_t* qs = s + 4;  // weight k < 16: qs[k] & 15; k >= 16: qs[k - 16] >> 4
  uint32_t* words = reinterpret_cast<uint32_t*>(out + 2 * kNR * 2);
  for (int g = 0; g < 4; ++g) words[g * kNR + j] = nibble_word(qs + 8 * (g % 2), g >= 2);
}

void fill_q8_0(const uint8_t* s, int j, uint8_t* out) {
  reinterpret_cast<float*>(out)[j] = half_at(s);
  uint32_t* words = reinterpret_cast<uint32_t*>(out + kNR * 4);
  for (int g = 0; g < 8; ++g) std::memcpy(&words[g * kNR + j], s + 2 + 4 * g, 4);
}

void fill_q4_k(const uint8_t* s, int j, uint8_t* out) {
  float* d = reinterpret_cast<float*>(out);
  d[j] = half_at(s);
  d[kNR + j] = half_at(s + 2);
  uint32_t* scale_words = reinterpret_cast<uint32_t*>(out + 2 * kNR * 4);
  for (int sb = 0; sb < 8; ++sb) {
    int sc = 0, mn = 0;
    gguf_blocks::scale_min_k4(s + 4, sb, &sc, &mn);
    scale_words[(sb / 2) * kNR + j] |= static_cast<uint32_t>(sc | mn << 8) << (16 * (sb & 1));
    // sub-block sb's weight l: nibble (sb & 1) of byte 32 (sb / 2) + l of qs
    const uint8_t* qs = s + 16 + 32 * (sb / 2);
    uint32_t* words = reinterpret_cast<uint32_t*>(out + 384 + sb * 256);
    for (int g = 0; g < 4; ++g) words[g * kNR + j] = nibble_word(qs + 8 * g, sb & 1);
  }
}

// Q6_K: weight f's 6-bit code is nibble (f / 64) % 2 of ql[64 (f / 128) + f % 64] with bits
// (f / 32) % 4 of qh[32 (f / 128) + f % 32] as its top two (gguf_blocks.h q6_k); it is stored
// less 32, as an int8. Eight codes at a time in the bytes of a word.
void fill_q6_k(const uint8_t* s, int j, uint8_t* out) {
  constexpr uint64_t k32 = 0x2020202020202020ULL;
  reinterpret_cast<float*>(out)[j] = half_at(s + 208);
  for (int sb = 0; sb < 16; ++sb) out[kNR * 4 + sb * kNR + j] = s[192 + sb];
  for (int f = 0; f < 256; f += 8) {
    const int h = f / 128, r = f % 128;
    uint64_t lo, hi;
    std::memcpy(&lo, s + h * 64 + r % 64, 8);
    std::memcpy(&hi, s + 128 + h * 32 + r % 32, 8);
    const uint64_t v = ((lo >> (4 * (r / 64))) & 0x0F0F0F0F0F0F0F0FULL) |
                       (((hi >> (2 * (r / 32))) & 0x0303030303030303ULL) << 4);
    // v - 32 in each byte (v < 64): bit 5 flipped, and bits 6 and 7 set where it was clear
    const uint64_t borrow = ~v & k32;
    const uint64_t q = (v ^ k32) | borrow << 1 | borrow << 2;
    for (int t = 0; t < 8; ++t) out[320 + (f + t) * kNR + j] = static_cast<uint8_t>(q >> (8 * t));
  }
}

// GGUF rows [N, nb * source bytes] -> panels (module comment), columns >= N zero, a few groups
// of panels per pool task. `release`: the rows are a file's memory map, whose pages are
// unmapped as they are consumed (so packing a 30 MB lm_head does not hold its 30 MB of file
// pages until the end as well).
template <Format F>
void fill_gguf_panels(const uint8_t* src, int64_t row_bytes, int64_t N, int64_t K,
                      uint8_t* dst, bool release) {
  using Lay = Layout<F>;
  const int64_t nb = K / Lay::kValues, P = (N + kNR - 1) / kNR;
  const int64_t G = (P + kGroup - 1) / kGroup;  // a group's blocks are contiguous (block_index)
  const int64_t block = Lay::kBytes, source = source_bytes(F);
  constexpr auto fill = F == panel::kQ4_1   ? &fill_q4_1
                        : F == panel::kQ8_0 ? &fill_q8_0
                        : F == panel::kQ4_K ? &fill_q4_k
                                            : &fill_q6_k;
  constexpr int64_t kReleaseGroups = 64;
  const auto rows_of = [&](int64_t g) { return src + std::min(g * kGroup * kNR, N) * row_bytes; };
  const auto fill_groups = [&](int64_t g0, int64_t g1) {
    std::memset(dst + g0 * kGroup * nb * block, 0,
                (std::min(g1 * kGroup, P) - g0 * kGroup) * nb * block);
    for (int64_t g = g0; g < g1; ++g) {
      if (release && g > g0 && (g - g0) % kReleaseGroups == 0)
        release_pages(rows_of(g - kReleaseGroups), rows_of(g));
      for (int64_t p = g * kGroup; p < std::min((g + 1) * kGroup, P); ++p)
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* out = dst + block_index(p, b, nb, P) * block;
          for (int j = 0; j < kNR && p * kNR + j < N; ++j)
            fill(src + (p * kNR + j) * row_bytes + b * source, j, out);
        }
    }
    if (release) release_pages(rows_of(std::max(g0, g1 - kReleaseGroups)), rows_of(g1));
  };
  const int nthreads = at::get_num_threads();
  const int64_t n = std::min<int64_t>(G, 4 * nthreads);
  TaskPool::get().run(n, nthreads, [&](int64_t t) { fill_groups(G * t / n, G * (t + 1) / n); });
}

}  // namespace

at::Tensor gguf_pack_cpu(const at::Tensor& blocks, const std::string& type, int64_t K,
                         bool release_rows) {
  TORCH_CHECK(type == "Q4_1" || type == "Q8_0" || type == "Q4_K" || type == "Q6_K",
              "pack_gguf_panels: type must be Q4_1, Q8_0, Q4_K or Q6_K, got ", type);
  const Format f = type == "Q4_1"   ? panel::kQ4_1
                   : type == "Q8_0" ? panel::kQ8_0
                   : type == "Q4_K" ? panel::kQ4_K
                                    : panel::kQ6_K;
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "pack_gguf_panels: blocks must be a 2-D uint8 CPU tensor [N, row bytes]");
  const int64_t values = panel::block_values(f);
  TORCH_CHECK(K >= values && K % values == 0 && K <= INT32_MAX,
              "pack_gguf_panels: K must be a positive multiple of ", values, " for ", type,
              ", got ", K);
  const int64_t N = blocks.size(0);
  const int64_t source = source_bytes(f);
  TORCH_CHECK(N >= 1 && N <= INT32_MAX && blocks.size(1) == K / values * source,
              "pack_gguf_panels: ", type, " rows of K = ", K, " are ", K / values * source,
              " bytes; blocks is [", N, ", ", blocks.size(1), "]");
  TORCH_CHECK(!release_rows || blocks.is_contiguous(),
              "pack_gguf_panels: release_rows needs contiguous rows (a view of the file's map)");
  const at::Tensor src = blocks.contiguous();
  const int64_t P = (N + kNR - 1) / kNR;
  at::Tensor out = at::empty({panel::kHeaderBytes + P * panel::panel_bytes(f, K)},
                             blocks.options());
  panel::advise_huge_pages(out.data_ptr(), out.numel());
  panel::write_header(out, N, K, f);
  uint8_t* dst = out.data_ptr<uint8_t>() + panel::kHeaderBytes;
  with_format(f, [&]<Format F>() {
    fill_gguf_panels<F>(src.data_ptr<uint8_t>(), src.size(1), N, K, dst, release_rows);
  });
  return out;
}

namespace panel {

// NOTE: measured on SmolLM2's layer linears, 2 threads. AVX-512 (a Sapphire-Rapids-class Xeon),
// time against the fp32 panels: in registers 0.57 / 0.91 / 0.98 / 1.02 / 1.08 at 9 / 16 / 48 /
// 64 / 96 rows, decoded 1.01 / 1.00 / 1.01 at 48 / 64 / 96 and 1.03 at 224 (the decoding itself
// is ~2 % of that call). AVX2 (Zen 3), decoded against in registers (scripts/
// bench_gguf_linear.py, two runs): 1-7 rows 1.2-1.6x the time, 8 rows 0.75x, 16 rows 0.59x,
// 48 rows 0.46x; the 1B file's Q4_K at 8 / 16 / 48 rows: likewise.
int64_t gguf_few_rows() { return current_isa() == Isa::kAvx2 ? 7 : 48; }

void decode_gguf_panels(const Header& h, const uint8_t* panels, int64_t p0, int64_t p1,
                        float* out) {
  with_format(h.format, [&]<Format F>() { decode_any<F>(panels, h.N, h.K, p0, p1, out); });
}

void gguf_panel_linear(const at::Tensor& x, const at::Tensor& packed, const Header& h,
                       const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0);
  const Kernel kern = with_format(h.format, [&]<Format F>() { return pick_kernel<F>(M); });
  // NOTE: x is read in place, each row by its own pointer (copied only where its rows would
  // share L1 sets: x_row_stride): transposing it into [K, mr] chunks first (as the fp32
  // panels do) was a serial ~1.5-4 us on the caller before the helpers could start, per call;
  // the broadcasts hit L1 either way.
  thread_local std::vector<float> x_store;  // the calling thread's, reused
  const int64_t ldx = M > 1 ? x_row_stride(h.K) : h.K;
  Args a{rows_at_stride(x.data_ptr<float>(), M, h.K, ldx, x_store),
         packed.data_ptr<uint8_t>() + h.offset, bias, y.data_ptr<float>(), M, h.N, h.K, ldx};
  // One thread's time, roughly: the blocks at ~20 GB/s, the dequantization (~4 vector ops per
  // 16 weights per row chunk, ~3 per ns) or the flops at ~80 GFLOP/s.
  const double chunks = static_cast<double>((M + kern.mr_max - 1) / kern.mr_max);
  const double weights = static_cast<double>(h.P) * kNR * h.K;
  const double bytes = static_cast<double>(h.P) * panel_bytes(h.format, h.K);
  const double est_ns =
      std::max({bytes / 20.0, chunks * weights / 12.0, 2.0 * M * weights / 80.0});
  const int nthreads = est_ns < kSplitNs ? 1 : at::get_num_threads();
  const int64_t n = std::min(pool_tasks(bytes, nthreads), h.P);
  // NOTE: ranges start on multiples of 4 panels (a small row tile's group): a range ending in a
  // short group runs it at fewer FMA chains (one row, down's 36 panels in 8 ranges: +15-20 %).
  static_assert(kGroup == 4, "thread ranges start on a group");
  const auto start = [&](int64_t t) { return t == n ? h.P : h.P * t / n & ~int64_t{3}; };
  TaskPool::get().run(n, nthreads, [&](int64_t t) { kern.run(a, start(t), start(t + 1)); });
}

}  // namespace panel
}  // namespace freetoken
