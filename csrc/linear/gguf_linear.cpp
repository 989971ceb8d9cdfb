// The block-resident linear: y [M, N] = x [M, K] @ W^T (+ bias) in fp32, where W stays in the
// GGUF file's blocks, read where the file's read-only memory map has them (issue 21). No fp32
// copy of W exists; N processes that map one file share one page-cache copy of it.
//
// Exactness: every weight is decoded to exactly the fp32 value gguf.quants.dequantize gives (the
// formulas of gguf_blocks.h: an integer code times exact fp32 scales, at most one rounding), and
// the arithmetic is fp32 FMAs. So the logits are those of the dequantized model up to summation
// order, and that order is fixed too (below).
//
// One summation order for every step (issue 23): y[m, n] is the sum of 16 lane sums, lane j
// holding x[m, k] * W[n, k] for k = j mod 16 in increasing k, accumulated by FMA, then added in
// the fixed tree of reduce16 (lanes i + i+8, i + i+4, i + i+2, i + i+1). Nothing in it depends on
// the step's row count, the rows beside m, the thread count or how K is chunked: a token's
// projections give the same bits alone, in a batch of 200, or after a cached prefix. AVX2 keeps
// the same 16 lane sums in two 8-lane vectors and gives the same bits as AVX-512; the baseline
// x86-64 variant has no FMA and its own bits.
//
// Two loops, one order:
//  * few rows (M <= kFewRows on AVX-512, 4 on AVX2; decode): the register tile of MR rows x NR
//    outputs walks K once; each weight vector is decoded in registers from its block (vpmovzxbd,
//    shift, mask, convert, one FMA with the scale) and used by the MR rows. The blocks stream
//    from memory once a step.
//  * many rows (prefill, classify): per tile of 16 outputs and chunk of kChunk k, the weights are
//    decoded once into an L1-resident fp32 tile, then every row of the step runs against it
//    (MR x NR FMA micro-kernel); the lane sums carry between chunks in a per-tile buffer, exactly
//    (fp32 stores), so the order is the few-rows loop's. Dequantization is amortized over M rows
//    and the GEMM stays compute bound. x is first copied chunk by chunk ([chunk][M][chunk's k]):
//    a chunk's rows are then one contiguous stream.
// Formats decoded in registers (AVX-512 and AVX2): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q4_K, Q5_K, Q6_K. Q2_K, Q3_K, IQ4_NL, IQ4_XS (and every format on the baseline variant) decode
// a block at a time through gguf_blocks.h into a buffer, then the same FMAs.
//
// The weight is a descriptor (gguf_matrix_pack): N row addresses plus segments (a fused q|k|v may
// mix types); the caller keeps the mapping alive.
#include "linear/gguf_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/isa.h"
#include "common/task_pool.h"
#include "common/vec.h"
#include "linear/gguf_args.h"
#include "linear/gguf_blocks.h"
#include "linear/panel_common.h"

namespace freetoken {

namespace {

using vec::loadu;
using vec::storeu;
using vec::Vec;

enum Type : int32_t {
  kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1,
  kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kNumTypes
};

struct TypeInfo {
  const char* name;
  int values;  // a block's weights (plain types: a "block" of 16)
  int bytes;   // its bytes
};

constexpr TypeInfo kTypes[kNumTypes] = {
    {"F32", 16, 64},     {"F16", 16, 32},     {"BF16", 16, 32},   {"Q8_0", 32, 34},
    {"Q4_0", 32, 18},    {"Q4_1", 32, 20},    {"Q5_0", 32, 22},   {"Q5_1", 32, 24},
    {"Q2_K", 256, 84},   {"Q3_K", 256, 110},  {"Q4_K", 256, 144}, {"Q5_K", 256, 176},
    {"Q6_K", 256, 210},  {"IQ4_NL", 32, 18},  {"IQ4_XS", 256, 136},
};

constexpr int kTile = 16;            // outputs per tile (a task's unit)
// k per decoded chunk in the many-rows loop: K cut into equal chunks of at most ~kChunk, whole
// blocks each. NOTE: the decoded tile (16 x chunk) and a row group's x must stay in L1: the
// dot-product micro-kernel reads 7 vectors per 12 FMAs, and with the whole of K = 576 (50 KB)
// it ran from L2 at ~70 % of the fp32 panels' rate.
constexpr int64_t kChunk = 256;
constexpr int kFewRows = 8;          // steps of at most this many rows take the few-rows loop
constexpr int64_t kRowBlock = 256;   // rows a pass of the many-rows loop (a call makes M / 256)
// NOTE: the few-rows loop asks for the block of the same position 4 NR rows ahead (the next
// tile's rows) while it decodes this one: one decode step reads every block from DRAM once, and
// a row is short (a 2048-wide Q4_K row is 18 cache lines), too short for the hardware
// prefetchers to ramp up on; prefetching 1 KB along the row itself mostly fetched the next row,
// which the tile was about to read anyway. The 1B file's layer linears at one row: 1 KB along
// the row 58-74 ms, NR rows ahead 39-49, 4 NR 33-34 (8 NR: no clear change, a noisy run).

// --- the descriptor -----------------------------------------------------------------------------

constexpr int32_t kMagic = 0x4D475446;  // "FTGM"
constexpr int32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 64;
// Header (int32 words): magic, version, N, K, number of segments, 0...; then per segment
// {int32 type, int32 0, int64 end row}; then N int64 row addresses.
struct Segment {
  int32_t type, pad;
  int64_t end;
};

struct Matrix {
  int64_t N, K;
  const Segment* segments;
  int64_t nseg;
  const uint8_t* const* rows;
};

Matrix read_matrix(const at::Tensor& d, const char* op) {
  TORCH_CHECK(d.device().is_cpu() && d.dim() == 1 && d.is_contiguous() &&
                  d.scalar_type() == at::kByte && d.numel() >= kHeaderBytes,
              op, ": weight must be the 1-D uint8 tensor from gguf_matrix");
  int32_t h[kHeaderBytes / 4];
  std::memcpy(h, d.data_ptr(), sizeof h);
  TORCH_CHECK(h[0] == kMagic && h[1] == kVersion, op, ": weight has no gguf_matrix header");
  Matrix m{h[2], h[3], nullptr, h[4], nullptr};
  TORCH_CHECK(m.N >= 1 && m.K >= 1 && m.nseg >= 1 &&
                  d.numel() == kHeaderBytes + m.nseg * 16 + m.N * 8,
              op, ": the gguf_matrix header does not match its size");
  const uint8_t* p = d.data_ptr<uint8_t>() + kHeaderBytes;
  m.segments = reinterpret_cast<const Segment*>(p);
  m.rows = reinterpret_cast<const uint8_t* const*>(p + m.nseg * 16);
  return m;
}

// --- decoding 16 weights at a time ---------------------------------------------------------------

// L bytes -> L int32 lanes, zero- or sign-extended; L uint16 -> L uint32; L fp16 -> L fp32.
// NOTE: inline asm, not intrinsics: these are called from templates compiled per ISA through
// the entry points' target attributes (common/isa.h), where an intrinsic's own target check
// fails; and GCC 12 scalarizes a widening __builtin_convertvector from uint8 lanes.
// One widening load per ISA: `insn` reads L elements of `bytes` bytes each at p into L 32-bit
// lanes (a zmm on AVX-512, a ymm on AVX2).
#define FT_WIDENING_LOAD(name, insn, lanes, bytes)                                          \
  template <int L>                                                                          \
  FT_INLINE typename Vec<L>::lanes name(const uint8_t* p) {                                 \
    static_assert(L == 16 || L == 8);                                                       \
    typename Vec<L>::lanes r;                                                               \
    if constexpr (L == 16) {                                                                \
      asm(insn " %1, %0" : "=v"(r) : "m"(*reinterpret_cast<const uint8_t(*)[16 * bytes]>(p))); \
    } else {                                                                                \
      asm(insn " %1, %0" : "=x"(r) : "m"(*reinterpret_cast<const uint8_t(*)[8 * bytes]>(p)));  \
    }                                                                                       \
    return r;                                                                               \
  }
FT_WIDENING_LOAD(widen_u8, "vpmovzxbd", i, 1)
FT_WIDENING_LOAD(widen_s8, "vpmovsxbd", i, 1)
FT_WIDENING_LOAD(widen_u16, "vpmovzxwd", u, 2)
FT_WIDENING_LOAD(half_lanes, "vcvtph2ps", f, 2)
#undef FT_WIDENING_LOAD

// *p on every lane, loaded by the broadcast itself (vec::splat adds to zero, a scalar add and a
// shuffle each).
template <int L>
FT_INLINE typename Vec<L>::f broadcast(const float* p) {
  static_assert(L == 16 || L == 8);
  typename Vec<L>::f r;
  if constexpr (L == 16) {
    asm("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
  } else {
    asm("vbroadcastss %1, %0" : "=x"(r) : "m"(*p));
  }
  return r;
}

// A byte's low or high nibble (bytes widened to lanes: the high needs no mask).
template <int L>
FT_INLINE typename Vec<L>::i nibble(typename Vec<L>::i bytes, bool high) {
  return high ? bytes >> 4 : bytes & 15;
}

// Codes put together on 16 bytes (one vector for 16 weights), then widened: the K-quants whose
// code bits lie in two places (Q5_K, Q6_K).
typedef uint8_t u8x16 __attribute__((vector_size(16)));
FT_INLINE u8x16 load16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  return v;
}
// Every byte shifted left (by > 0) or right (by < 0), as 16-bit lanes: mask off what crosses.
FT_INLINE u8x16 shift_bytes(u8x16 v, int by) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  const u16x8 w = reinterpret_cast<u16x8>(v);
  return reinterpret_cast<u8x16>(by >= 0 ? w << by : w >> -by);
}
FT_INLINE u8x16 nibbles(u8x16 v, bool high) { return high ? shift_bytes(v, -4) & 15 : v & 15; }
// 16 bytes -> 16 lanes, in 16 / L vectors (inline asm: GCC scalarizes the widening convert).
template <int L>
FT_INLINE void widen_bytes(u8x16 q, typename Vec<L>::i (&out)[16 / L]) {
  if constexpr (L == 16) {
    asm("vpmovzxbd %1, %0" : "=v"(out[0]) : "x"(q));
  } else {
    static_assert(L == 8);
    const u8x16 hi = __builtin_shuffle(q, u8x16{8, 9, 10, 11, 12, 13, 14, 15,
                                                8, 9, 10, 11, 12, 13, 14, 15});
    asm("vpmovzxbd %1, %0" : "=x"(out[0]) : "x"(q));
    asm("vpmovzxbd %1, %0" : "=x"(out[1]) : "x"(hi));
  }
}

template <int L>
FT_INLINE typename Vec<L>::f to_float(typename Vec<L>::i q) {
  return __builtin_convertvector(q, typename Vec<L>::f);
}
template <int L>
FT_INLINE typename Vec<L>::u lane_index(uint32_t first) {
  typename Vec<L>::u r;
#pragma GCC unroll 16
  for (int i = 0; i < L; ++i) r[i] = first + i;
  return r;
}

// fp16 scales -> fp32 by F16C (vcvtph2ps; exact, as gguf_blocks' half_to_float, which costs ~12
// scalar ops and a branch: at one row that was most of a Q4_1 block's work). Two adjacent halves
// (d, m) in one conversion.
FT_INLINE void half_pair(const uint8_t* p, float* a, float* b) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const typename Vec<4>::u in = {bits, 0, 0, 0};
  typename Vec<4>::f out;
  asm("vcvtph2ps %1, %0" : "=x"(out) : "x"(in));
  *a = out[0];
  *b = out[1];
}
FT_INLINE float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  const typename Vec<4>::u in = {bits, 0, 0, 0};
  typename Vec<4>::f out;
  asm("vcvtph2ps %1, %0" : "=x"(out) : "x"(in));
  return out[0];
}

// A decoder per format: open(block) once per block, then vec(j, w) = weights [16 j, 16 j + 16) of
// it as V = 16 / L vectors. Each weight is exactly gguf_blocks.h's value (module comment).
template <int L, Type T>
struct Decoder;

template <int L>
struct Base {
  using vf = typename Vec<L>::f;
  using vi = typename Vec<L>::i;
  using vu = typename Vec<L>::u;
  static constexpr int V = 16 / L;
  const uint8_t* b;
};

template <int L>
struct Decoder<L, kF32> : Base<L> {
  FT_INLINE void open(const uint8_t* p) { this->b = p; }
  FT_INLINE void vec(int, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v)
      w[v] = loadu<L>(reinterpret_cast<const float*>(this->b) + v * L);
  }
};

template <int L>
struct Decoder<L, kF16> : Base<L> {
  FT_INLINE void open(const uint8_t* p) { this->b = p; }
  FT_INLINE void vec(int, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v) w[v] = half_lanes<L>(this->b + 2 * v * L);
  }
};

template <int L>
struct Decoder<L, kBF16> : Base<L> {
  FT_INLINE void open(const uint8_t* p) { this->b = p; }
  FT_INLINE void vec(int, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v)
      w[v] = reinterpret_cast<typename Base<L>::vf>(widen_u16<L>(this->b + 2 * v * L) << 16);
  }
};

template <int L>
struct Decoder<L, kQ8_0> : Base<L> {  // d, qs[32] int8: w = q * d
  typename Base<L>::vf d;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    d = vec::splat<L>(half_to_float(p));
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v)
      w[v] = to_float<L>(widen_s8<L>(this->b + 2 + 16 * j + v * L)) * d;
  }
};

// 4-bit codes on AVX-512: the 16 possible weights of a block (or sub-block) as one vector, a
// table, and each code's weight one vpermps from it (which reads only an index's low 4 bits:
// no mask, no convert, no FMA per vector). Each table entry is the scalar formula's value:
// fma(q, d, m) rounds once, as d * q + m does with d * q exact.
FT_INLINE typename Vec<16>::f lookup(typename Vec<16>::f table, typename Vec<16>::i codes) {
  return __builtin_shuffle(table, codes);  // indices modulo 16
}
FT_INLINE typename Vec<16>::f codes_0_15() {
  return typename Vec<16>::f{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}

template <int L>
struct Decoder<L, kQ4_0> : Base<L> {  // d, qs[16]: w = (q - 8) * d, q low nibbles then high
  typename Base<L>::vf d;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    if constexpr (L == 16) {
      d = (codes_0_15() - 8.f) * vec::in_register(vec::splat<L>(half_to_float(p)));
    } else {
      d = vec::splat<L>(half_to_float(p));
    }
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v) {
      const typename Base<L>::vi q = widen_u8<L>(this->b + 2 + v * L);
      if constexpr (L == 16) {
        w[v] = lookup(d, j ? q >> 4 : q);
      } else {
        w[v] = to_float<L>((j ? q >> 4 : q & 15) - 8) * d;
      }
    }
  }
};

template <int L>
struct Decoder<L, kQ4_1> : Base<L> {  // d, m, qs[16]: w = q * d + m
  typename Base<L>::vf d, m;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    float dd, mm;
    half_pair(p, &dd, &mm);
    d = vec::splat<L>(dd);
    m = vec::splat<L>(mm);
    if constexpr (L == 16) d = codes_0_15() * vec::in_register(d) + m;  // the table
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v) {
      const typename Base<L>::vi q = widen_u8<L>(this->b + 4 + v * L);
      if constexpr (L == 16) {
        w[v] = lookup(d, j ? q >> 4 : q);
      } else {
        w[v] = to_float<L>(j ? q >> 4 : q & 15) * d + m;
      }
    }
  }
};

template <int L>
struct Decoder<L, kIQ4_NL> : Base<L> {  // d, qs[16]: w = d * kIq4Values[q]
  typename Base<L>::vf table;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    table = iq4_values() * vec::in_register(vec::splat<16>(half_to_float(p)));
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    const typename Base<L>::vi q = widen_u8<L>(this->b + 2);
    w[0] = lookup(table, j ? q >> 4 : q);
  }
  static FT_INLINE typename Vec<16>::f iq4_values() {
    return typename Vec<16>::f{-127, -104, -83, -65, -49, -35, -22, -10,
                               1,    13,   25,  38,  53,  69,  89,  113};
  }
};

// Q5_0 / Q5_1: the nibble of qs plus bit (16 j + lane) of qh as bit 4.
template <int L>
FT_INLINE typename Vec<L>::i five_bits(const uint8_t* qs, uint32_t qh, int j, int v) {
  const typename Vec<L>::i q = widen_u8<L>(qs + v * L);
  const typename Vec<L>::u hi = ((typename Vec<L>::u{} + qh) >> lane_index<L>(16 * j + v * L)) & 1;
  return (j ? q >> 4 : q & 15) | typename Vec<L>::i(hi << 4);
}

template <int L>
struct Decoder<L, kQ5_0> : Base<L> {  // d, qh (u32), qs[16]: w = (q - 16) * d
  typename Base<L>::vf d;
  uint32_t qh;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    d = vec::splat<L>(half_to_float(p));
    std::memcpy(&qh, p + 2, 4);
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v)
      w[v] = to_float<L>(five_bits<L>(this->b + 6, qh, j, v) - 16) * d;
  }
};

template <int L>
struct Decoder<L, kQ5_1> : Base<L> {  // d, m, qh (u32), qs[16]: w = q * d + m
  typename Base<L>::vf d, m;
  uint32_t qh;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    float dd, mm;
    half_pair(p, &dd, &mm);
    d = vec::splat<L>(dd);
    m = vec::splat<L>(mm);
    std::memcpy(&qh, p + 4, 4);
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v)
      w[v] = to_float<L>(five_bits<L>(this->b + 8, qh, j, v)) * d + m;
  }
};

// Q4_K / Q5_K: eight sub-blocks of 32, each with a 6-bit scale and min: w = (d sc) q - dmin mn.
template <int L>
struct KScales : Base<L> {
  float dsc[8], dmn[8];
  // The eight 6-bit scales and mins of the 12 scale bytes (gguf_blocks::scale_min_k4) in one
  // 16-byte vector (~20 vector ops a block; built lane by lane from scalar extracts it was ~85
  // instructions, a fifth of a one-row step's). With A, B, C the scale bytes 0-3, 4-7, 8-11:
  // scales 0-3 = A & 63, 4-7 = (C & 15) | (A >> 6) << 4; mins 0-3 = B & 63, 4-7 = C >> 4 |
  // (B >> 6) << 4.
  FT_INLINE void open_scales(const uint8_t* p) {
    this->b = p;
    float d, dmin;
    half_pair(p, &d, &dmin);
    using v8 = typename Vec<8>::f;
    // the 12 scale bytes and 4 bytes of codes (unused): one load, no store-forwarding stall
    const u8x16 s = load16(p + 4);
    // lo: A C B C; hi: 0 A 0 B (indices >= 16 take the zero vector)
    const u8x16 lo = __builtin_shuffle(s, u8x16{0, 1, 2, 3, 8, 9, 10, 11,
                                                4, 5, 6, 7, 8, 9, 10, 11});
    const u8x16 hi = __builtin_shuffle(s, u8x16{}, u8x16{16, 16, 16, 16, 0, 1, 2, 3,
                                                         16, 16, 16, 16, 4, 5, 6, 7});
    const u8x16 six =
        (lo & u8x16{63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0}) |
        (shift_bytes(lo, -4) & u8x16{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15}) |
        (shift_bytes(hi, -2) & u8x16{0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48});
    typename Vec<8>::i six_lanes[2];  // the scales, the mins
    widen_bytes<8>(six, six_lanes);
    storeu<8>(dsc, __builtin_convertvector(six_lanes[0], v8) * vec::in_register(v8{} + d));
    storeu<8>(dmn, __builtin_convertvector(six_lanes[1], v8) * vec::in_register(v8{} + dmin));
  }
};

template <int L>
struct Decoder<L, kQ4_K> : KScales<L> {  // d, dmin, scales[12], qs[128]
  FT_INLINE void open(const uint8_t* p) { this->open_scales(p); }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    const int g = j >> 1;  // sub-block: 32-byte chunk g / 2, nibble g % 2
    const uint8_t* q = this->b + 16 + (g >> 1) * 32 + (j & 1) * 16;
    const auto d = broadcast<L>(this->dsc + g), mn = broadcast<L>(this->dmn + g);
    if constexpr (L == 16) {  // the sub-block's table, shared by its two vectors
      w[0] = lookup(codes_0_15() * d - mn, widen_u8<L>(q) >> (4 * (g & 1)));
    } else {
      for (int v = 0; v < Base<L>::V; ++v)
        w[v] = to_float<L>(nibble<L>(widen_u8<L>(q + v * L), g & 1)) * d - mn;
    }
  }
};

template <int L>
struct Decoder<L, kQ5_K> : KScales<L> {  // d, dmin, scales[12], qh[32], qs[128]
  FT_INLINE void open(const uint8_t* p) { this->open_scales(p); }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    const int g = j >> 1;  // the nibble of qs as Q4_K, bit g of qh[(j % 2) 16 + l] as bit 4
    const u8x16 ql = load16(this->b + 48 + (g >> 1) * 32 + (j & 1) * 16);
    const u8x16 qh = load16(this->b + 16 + (j & 1) * 16);
    typename Base<L>::vi q[Base<L>::V];
    widen_bytes<L>(nibbles(ql, g & 1) | (shift_bytes(qh, 4 - g) & 16), q);
    const auto d = broadcast<L>(this->dsc + g), mn = broadcast<L>(this->dmn + g);
    for (int v = 0; v < Base<L>::V; ++v) w[v] = to_float<L>(q[v]) * d - mn;
  }
};

// Q6_K: the 6-bit code of 16 weights is put together on their bytes (one 16-byte vector), then
// widened. w = (q - 32) * s is computed as q * s - 32 s in one FMA, exactly: s = d * sc holds at
// most 18 significant bits (fp16 d, int8 sc) and q - 32 at most 5, so (q - 32) * s is an fp32
// number and the FMA's one rounding leaves it as it is.
template <int L>
struct Decoder<L, kQ6_K> : Base<L> {  // ql[128], qh[64], scales[16] int8, d: w = d sc (q - 32)
  alignas(32) float s[16], s32[16];  // per 16 weights: d sc and 32 d sc
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    using v8 = typename Vec<8>::f;
    using i8 = typename Vec<8>::i;
    const v8 d = v8{} + half_to_float(p + 208);
    const i8 lo = widen_s8<8>(p + 192), hi = widen_s8<8>(p + 200);  // the 16 int8 scales
    const v8 s_lo = __builtin_convertvector(lo, v8) * d, s_hi = __builtin_convertvector(hi, v8) * d;
    storeu<8>(s, s_lo);
    storeu<8>(s + 8, s_hi);
    storeu<8>(s32, s_lo * 32.f);
    storeu<8>(s32 + 8, s_hi * 32.f);
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    // weights f = 16 j + l: half h = j / 8, r = f % 128; low 4 bits from ql[64 h + r % 64]
    // (nibble r / 64), high 2 from qh[32 h + r % 32] (bits 2 (r / 32)); scale j.
    const int h = j >> 3;
    const u8x16 ql = load16(this->b + h * 64 + (j & 3) * 16);
    const u8x16 qh = load16(this->b + 128 + h * 32 + (j & 1) * 16);
    typename Base<L>::vi q[Base<L>::V];
    widen_bytes<L>(nibbles(ql, (j >> 2) & 1) | (shift_bytes(qh, 4 - 2 * ((j >> 1) & 3)) & 48), q);
    const auto sj = broadcast<L>(s + j), s32j = broadcast<L>(s32 + j);
    for (int v = 0; v < Base<L>::V; ++v) w[v] = to_float<L>(q[v]) * sj - s32j;
  }
};

// Every other format (and every format on the baseline variant): the block decoded by its scalar
// function into a buffer.
template <Type T>
FT_INLINE void scalar_block(const uint8_t* p, float* y) {
  namespace gb = gguf_blocks;
  if constexpr (T == kF32) std::memcpy(y, p, 64);
  else if constexpr (T == kF16) for (int i = 0; i < 16; ++i) gb::f16(p + 2 * i, y + i);
  else if constexpr (T == kBF16) for (int i = 0; i < 16; ++i) gb::bf16(p + 2 * i, y + i);
  else if constexpr (T == kQ8_0) gb::q8_0(p, y);
  else if constexpr (T == kQ4_0) gb::q4_0(p, y);
  else if constexpr (T == kQ4_1) gb::q4_1(p, y);
  else if constexpr (T == kQ5_0) gb::q5_0(p, y);
  else if constexpr (T == kQ5_1) gb::q5_1(p, y);
  else if constexpr (T == kQ2_K) gb::q2_k(p, y);
  else if constexpr (T == kQ3_K) gb::q3_k(p, y);
  else if constexpr (T == kQ4_K) gb::q4_k(p, y);
  else if constexpr (T == kQ5_K) gb::q5_k(p, y);
  else if constexpr (T == kQ6_K) gb::q6_k(p, y);
  else if constexpr (T == kIQ4_NL) gb::iq4_nl(p, y);
  else gb::iq4_xs(p, y);
}

template <int L, Type T>
struct Buffered : Base<L> {
  alignas(64) float buf[kTypes[T].values];
  FT_INLINE void open(const uint8_t* p) { scalar_block<T>(p, buf); }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    for (int v = 0; v < Base<L>::V; ++v) w[v] = loadu<L>(buf + 16 * j + v * L);
  }
};

template <int L> struct Decoder<L, kQ2_K> : Buffered<L, kQ2_K> {};
template <int L> struct Decoder<L, kQ3_K> : Buffered<L, kQ3_K> {};
template <int L>
struct Decoder<L, kIQ4_XS> : Base<L> {  // d, scales_h (u16), scales_l[4], qs[128]
  float d;
  uint16_t sh;
  FT_INLINE void open(const uint8_t* p) {
    this->b = p;
    d = half_to_float(p);
    std::memcpy(&sh, p + 2, 2);
  }
  FT_INLINE void vec(int j, typename Base<L>::vf (&w)[Base<L>::V]) const {
    const int g = j >> 1;  // sub-block g: 16 bytes, low nibbles then high
    const int ls = ((this->b[4 + (g >> 1)] >> (4 * (g & 1))) & 15) | (((sh >> (2 * g)) & 3) << 4);
    const float dg = d * static_cast<float>(ls - 32);
    const typename Base<L>::vi q = widen_u8<L>(this->b + 8 + g * 16);
    w[0] = lookup(Decoder<16, kIQ4_NL>::iq4_values() * vec::in_register(vec::splat<16>(dg)),
                  (j & 1) ? q >> 4 : q);
  }
};

// The baseline variant (4 lanes, SSE2: no byte widening) decodes every format through the buffer.
template <int L, Type T>
using DecoderFor = std::conditional_t<
    L == 4 || (L == 8 && (T == kIQ4_NL || T == kIQ4_XS)), Buffered<L, T>, Decoder<L, T>>;

// --- the fixed summation order ---------------------------------------------------------------------

// The 16 lane sums of one output -> their sum, in the one tree (module comment).
FT_INLINE float reduce16(const float* a) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// 16 outputs' lane sums (a [16 outputs][16 lanes]) -> out[16], each exactly reduce16 of its row,
// four levels of shuffles over all 16 at once (3 ops an output instead of ~20).
template <int L>
FT_INLINE void reduce16x16(const float* a, float* out) {
  if constexpr (L != 16) {
    for (int n = 0; n < 16; ++n) out[n] = reduce16(a + 16 * n);
  } else {
    using vf = typename Vec<16>::f;
    using vi = typename Vec<16>::i;
    // c[p]: lanes 0-7 = output p's t8, lanes 8-15 = output p + 8's
    vf c[8];
    for (int p = 0; p < 8; ++p) {
      const vf x = loadu<16>(a + 16 * p), y = loadu<16>(a + 16 * (p + 8));
      c[p] = __builtin_shuffle(x, y, vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
             __builtin_shuffle(x, y, vi{8, 9, 10, 11, 12, 13, 14, 15,
                                        24, 25, 26, 27, 28, 29, 30, 31});
    }
    // d[p]: groups of 4 = t4 of outputs p, p + 8, p + 4, p + 12
    vf d[4];
    for (int p = 0; p < 4; ++p)
      d[p] = __builtin_shuffle(c[p], c[p + 4], vi{0, 1, 2, 3, 8, 9, 10, 11,
                                                  16, 17, 18, 19, 24, 25, 26, 27}) +
             __builtin_shuffle(c[p], c[p + 4], vi{4, 5, 6, 7, 12, 13, 14, 15,
                                                  20, 21, 22, 23, 28, 29, 30, 31});
    // e[p]: pairs = t2 of outputs p, p + 8, p + 4, p + 12, p + 2, p + 10, p + 6, p + 14
    vf e[2];
    for (int p = 0; p < 2; ++p)
      e[p] = __builtin_shuffle(d[p], d[p + 2], vi{0, 1, 4, 5, 8, 9, 12, 13,
                                                  16, 17, 20, 21, 24, 25, 28, 29}) +
             __builtin_shuffle(d[p], d[p + 2], vi{2, 3, 6, 7, 10, 11, 14, 15,
                                                  18, 19, 22, 23, 26, 27, 30, 31});
    // f: outputs 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15
    const vf f = __builtin_shuffle(e[0], e[1], vi{0, 2, 4, 6, 8, 10, 12, 14,
                                                  16, 18, 20, 22, 24, 26, 28, 30}) +
                 __builtin_shuffle(e[0], e[1], vi{1, 3, 5, 7, 9, 11, 13, 15,
                                                  17, 19, 21, 23, 25, 27, 29, 31});
    storeu<16>(out, __builtin_shuffle(f, vi{0, 8, 4, 12, 2, 10, 6, 14,
                                           1, 9, 5, 13, 3, 11, 7, 15}));
  }
}

// --- the two loops -----------------------------------------------------------------------------

struct Call {
  const float* x;  // [M, K] at row stride ldx (in place, or padded: panel::x_row_stride)
  int64_t M, K, N, ldx;
  // x copied chunk by chunk, [chunk c][M][its k] (many rows only; else null), and the chunk (k,
  // whole blocks of every segment's type).
  const float* x_chunks;
  int64_t chunk;
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  const uint8_t* const* rows;
  const int64_t* tile_n0;  // tiles: [tile_n0[t], tile_n1[t]) of one segment, <= kTile outputs
  const int64_t* tile_n1;
  const int32_t* tile_type;
};

// acc += w * x on every lane (FMA where the ISA has it: contracted, -ffp-contract=fast)
template <int L>
FT_INLINE typename Vec<L>::f fma(typename Vec<L>::f w, typename Vec<L>::f x,
                                 typename Vec<L>::f acc) {
  return acc + w * x;
}

// Few rows: rows [m0, m0 + MR) x outputs rows[0..NR) over all of K, decoded in registers.
// out[m][n] = the lane sums.
template <int L, Type T, int MR, int NR>
FT_INLINE void few_rows_tile(const Call& c, int64_t m0, const uint8_t* const (&rows)[NR],
                             const uint8_t* const (&ahead)[NR],
                             float (&sums)[MR][NR][16]) {
  using D = DecoderFor<L, T>;
  using vf = typename Vec<L>::f;
  constexpr int V = 16 / L, J = kTypes[T].values / 16, B = kTypes[T].bytes;
  vf acc[MR][NR][V];
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
    for (int n = 0; n < NR; ++n)
#pragma GCC unroll 64
      for (int v = 0; v < V; ++v) acc[m][n][v] = vf{};
  const int64_t nb = c.K / kTypes[T].values;
  const float* xm[MR];  // (row pointers: from m * K, GCC reloaded K and rebuilt each address)
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m) xm[m] = c.x + (m0 + m) * c.ldx;
  for (int64_t b = 0; b < nb; ++b) {
    D blk[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      __builtin_prefetch(ahead[n] + b * B, 0, 3);
      if constexpr (B > 64) __builtin_prefetch(ahead[n] + b * B + 64, 0, 3);
      if constexpr (B > 128) __builtin_prefetch(ahead[n] + b * B + 128, 0, 3);
      if constexpr (B > 192) __builtin_prefetch(ahead[n] + b * B + 192, 0, 3);
      blk[n].open(rows[n] + b * B);
    }
    const int64_t xo = b * kTypes[T].values;
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) {
      // x in registers when NR outputs share it; with one output each x is an FMA's operand
      vf xv[MR][V];
      if constexpr (NR > 1) {
#pragma GCC unroll 64
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
          for (int v = 0; v < V; ++v)
            xv[m][v] = vec::in_register(loadu<L>(xm[m] + xo + 16 * j + v * L));
      }
#pragma GCC unroll 64
      for (int n = 0; n < NR; ++n) {
        vf w[V];
        blk[n].vec(j, w);
        // (in a register for several rows: a buffered block's load is not folded into each FMA;
        // at one row the copy would only cost a move)
#pragma GCC unroll 64
        for (int v = 0; v < V; ++v)
          if constexpr (MR > 1) w[v] = vec::in_register(w[v]);
#pragma GCC unroll 64
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
          for (int v = 0; v < V; ++v) {
            if constexpr (NR > 1) {
              acc[m][n][v] = fma<L>(w[v], xv[m][v], acc[m][n][v]);
            } else {
              acc[m][n][v] = fma<L>(w[v], loadu<L>(xm[m] + xo + 16 * j + v * L), acc[m][n][v]);
            }
          }
      }
      // NOTE: a step's decoding stays with its FMAs: unrolled over a K-quant block, GCC decoded
      // all 16 x NR vectors first and spilled them to the stack. The barrier claims to write the
      // blocks only: a "memory" clobber made GCC also store every decoded and x vector to the
      // stack (dead stores, 4 in a step's ~30 instructions).
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n)
        asm volatile("" : "+m"(*reinterpret_cast<uint8_t(*)[B]>(
                              const_cast<uint8_t*>(rows[n] + b * B))));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n)
      for (int v = 0; v < V; ++v) storeu<L>(sums[m][n] + v * L, acc[m][n][v]);
}

// Outputs per register tile of the few-rows loop: enough FMA chains (MR x NR) at one row, fewer
// decoded vectors per FMA at eight. AVX2 at 3-4 rows: one output (8 accumulators in its 16
// registers).
template <int L, int MR>
constexpr int few_rows_nr() {
  if constexpr (L == 16) return MR <= 4 ? 4 : 2;
  return MR <= 2 ? 2 : 1;
}

template <int L, Type T, int MR>
FT_INLINE void few_rows_rows(const Call& c, int64_t n0, int64_t n1, int64_t m0) {
  constexpr int NR = few_rows_nr<L, MR>();
  for (int64_t n = n0; n < n1; n += NR) {
    const uint8_t* rows[NR];
    const uint8_t* ahead[NR];
    for (int i = 0; i < NR; ++i) {
      rows[i] = c.rows[std::min(n + i, n1 - 1)];  // tail: repeat
      ahead[i] = c.rows[std::min(n + i + 4 * NR, c.N - 1)];
    }
    float sums[MR][NR][16];
    few_rows_tile<L, T, MR, NR>(c, m0, rows, ahead, sums);
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < NR && n + i < n1; ++i)
        c.y[(m0 + m) * c.N + n + i] = reduce16(sums[m][i]) + (c.bias ? c.bias[n + i] : 0.f);
  }
}

template <int L, Type T, int MR>
FT_INLINE void few_rows_dispatch(const Call& c, int mr, int64_t n0, int64_t n1, int64_t m0) {
  if constexpr (MR > 1) {
    if (mr < MR) return few_rows_dispatch<L, T, MR - 1>(c, mr, n0, n1, m0);
  }
  few_rows_rows<L, T, MR>(c, n0, n1, m0);
}

// NOTE: AVX2 up to 4 rows: on a Zen 3 (1B-shaped Q4_K / Q5_K / Q6_K / Q8_0, 2048 x 2048, one
// core) 3 and 4 rows took 0.73-0.84x the many-rows loop's time, 5-8 rows the same time.
template <int L>
constexpr int few_rows_max() {
  return L == 16 ? kFewRows : L == 8 ? 4 : 1;
}

// Many rows: the micro-kernel, one vector of the 16 lanes (AVX2: a half): rows [0, MR) of x
// (row stride ldx) x outputs [0, NR) of the decoded tile w ([kTile][ldw]) over kv vectors of
// k, x, w and acc already at that lane vector. Lane sums in acc ([rows][kTile][16]), loaded
// unless this is K's first chunk.
template <int L, int MR, int NR>
FT_INLINE void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t ldw, int kv,
                            float* acc, bool first) {
  using vf = typename Vec<L>::f;
  vf a[MR][NR];
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
    for (int n = 0; n < NR; ++n) a[m][n] = first ? vf{} : loadu<L>(acc + (m * kTile + n) * 16);
  // one base pointer per operand row and one running offset: indexing from k made GCC spend
  // ~2 integer instructions per load on the addresses
  const float* wn[NR];
  const float* xm[MR];
#pragma GCC unroll 64
  for (int n = 0; n < NR; ++n) wn[n] = w + n * ldw;
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m) xm[m] = x + m * ldx;
  const int64_t end = 16 * static_cast<int64_t>(kv);
  for (int64_t o = 0; o < end; o += 16) {
    vf wv[NR];
#pragma GCC unroll 64
    for (int n = 0; n < NR; ++n) wv[n] = vec::in_register(loadu<L>(wn[n] + o));
#pragma GCC unroll 64
    for (int m = 0; m < MR; ++m) {
      const vf xv = vec::in_register(loadu<L>(xm[m] + o));
#pragma GCC unroll 64
      for (int n = 0; n < NR; ++n) a[m][n] = fma<L>(wv[n], xv, a[m][n]);
    }
  }
#pragma GCC unroll 64
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
    for (int n = 0; n < NR; ++n) storeu<L>(acc + (m * kTile + n) * 16, a[m][n]);
}

// Register tiles, a lane vector at a time: MR x NR accumulators, NR weight vectors and one x.
// AVX-512 3 rows x 4 outputs; AVX2 4 x 3 (all 16 registers; the tile's 16th output takes a 4 x 1
// pass); baseline (four) 1 x 1. NOTE: measured, not derived: on this project's Zen 5 the 3 x 4
// tile ran at 205-245 GF/s a core, 6 x 4 (24 accumulators) at 145-180, 2 x 8 at ~205. On a Zen 3
// (AVX2), 1B-shaped Q4_K, 2048 x 2048, 224 rows, one core: 4 x 3 a half at a time took 0.91x the
// time of 3 x 2 over both halves (7 loads for 12 FMAs, not 10), the base pointers 0.97x more.
template <int L>
constexpr int many_mr() { return L == 16 ? 3 : L == 8 ? 4 : 1; }
template <int L>
constexpr int many_nr() { return L == 16 ? 4 : L == 8 ? 3 : 1; }

template <int L, int MR>
FT_INLINE void micro_rows(int mr, const float* x, int64_t ldx, const float* w, int64_t ldw,
                          int kv, float* acc, bool first) {
  if constexpr (MR > 1) {
    if (mr < MR) return micro_rows<L, MR - 1>(mr, x, ldx, w, ldw, kv, acc, first);
  }
  constexpr int NR = many_nr<L>(), rest = kTile % NR;
  for (int v = 0; v < 16; v += L) {
    int n = 0;
    for (; n + NR <= kTile; n += NR)
      micro_kernel<L, MR, NR>(x + v, ldx, w + n * ldw + v, ldw, kv, acc + n * 16 + v, first);
    if constexpr (rest > 0)
      micro_kernel<L, MR, rest>(x + v, ldx, w + n * ldw + v, ldw, kv, acc + n * 16 + v, first);
  }
}

FT_INLINE int64_t chunk_of(int64_t K, int64_t block) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  return (K / block + chunks - 1) / chunks * block;
}

// The micro-kernel loop as its own (not inlined) function per ISA. NOTE: inlined into the
// per-format tile code, GCC ran short of general registers and reloaded an address from the
// stack in the FMA loop: ~155 GF/s a core against ~225 alone.
using MicroFn = void (*)(int, const float*, int64_t, const float*, int64_t, int, float*, bool);
FT_TARGET_AVX512 __attribute__((noinline)) void micro_avx512(
    int mr, const float* x, int64_t ldx, const float* w, int64_t ldw, int kv, float* acc,
    bool first) {
  micro_rows<16, many_mr<16>()>(mr, x, ldx, w, ldw, kv, acc, first);
}
FT_TARGET_AVX2 __attribute__((noinline)) void micro_avx2(
    int mr, const float* x, int64_t ldx, const float* w, int64_t ldw, int kv, float* acc,
    bool first) {
  micro_rows<8, many_mr<8>()>(mr, x, ldx, w, ldw, kv, acc, first);
}
__attribute__((noinline)) void micro_base(int mr, const float* x, int64_t ldx, const float* w,
                                          int64_t ldw, int kv, float* acc, bool first) {
  micro_rows<4, many_mr<4>()>(mr, x, ldx, w, ldw, kv, acc, first);
}
template <int L>
constexpr MicroFn micro_for() {
  return L == 16 ? &micro_avx512 : L == 8 ? &micro_avx2 : &micro_base;
}

template <int L, Type T>
FT_INLINE void many_rows_tile(const Call& c, int64_t n0, int64_t n1, float* w, float* acc) {
  using vf = typename Vec<L>::f;
  constexpr int V = 16 / L, J = kTypes[T].values / 16, B = kTypes[T].bytes;
  constexpr int MR = many_mr<L>();
  const int64_t chunk = c.chunk;
  const int64_t PB = chunk / kTypes[T].values;  // blocks a chunk
  const int64_t nb = c.K / kTypes[T].values;
  for (int64_t b0 = 0; b0 < nb; b0 += PB) {
    const int64_t b1 = std::min(nb, b0 + PB);
    const int kv = static_cast<int>((b1 - b0) * J);
    for (int i = 0; i < kTile; ++i) {  // decode the tile's chunk (tail outputs: repeat the last)
      const uint8_t* row = c.rows[std::min(n0 + i, n1 - 1)];
      // NOTE: ask for this row's next chunk (after the last, the next tile's row) while the rows
      // of the step run against this one: 16 rows a tile are 16 short streams, which the
      // hardware prefetchers did not keep ahead of (8 rows from DRAM ran ~10 % slower than hot).
      const uint8_t* next = b1 < nb ? row + b1 * B : c.rows[std::min(n0 + kTile + i, c.N - 1)];
      for (int64_t o = 0; o < (b1 - b0) * B; o += 64) __builtin_prefetch(next + o, 0, 3);
      for (int64_t b = b0; b < b1; ++b) {
        DecoderFor<L, T> blk;
        blk.open(row + b * B);
#pragma GCC unroll 16
        for (int j = 0; j < J; ++j) {
          vf wv[V];
          blk.vec(j, wv);
          for (int v = 0; v < V; ++v)
            storeu<L>(w + i * chunk + ((b - b0) * J + j) * 16 + v * L, wv[v]);
        }
      }
    }
    const int64_t k0 = b0 * kTypes[T].values, kc = (b1 - b0) * kTypes[T].values;
    const float* xc = c.x_chunks + k0 * c.M;  // this chunk's [M][kc]
    for (int64_t m0 = 0; m0 < c.M; m0 += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, c.M - m0));
      micro_for<L>()(mr, xc + m0 * kc, kc, w, chunk, kv, acc + m0 * kTile * 16, b0 == 0);
    }
  }
  float out[kTile];
  for (int64_t m = 0; m < c.M; ++m) {
    reduce16x16<L>(acc + m * kTile * 16, out);
    for (int64_t n = n0; n < n1; ++n)
      c.y[m * c.N + n] = out[n - n0] + (c.bias ? c.bias[n] : 0.f);
  }
}

template <int L, Type T>
FT_INLINE void run_tile(const Call& c, int64_t n0, int64_t n1, bool few, float* w, float* acc) {
  if (few) {
    few_rows_dispatch<L, T, few_rows_max<L>()>(c, static_cast<int>(c.M), n0, n1, 0);
  } else {
    many_rows_tile<L, T>(c, n0, n1, w, acc);
  }
}

FT_INLINE float* aligned64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// Tiles [t0, t1) of the call, by format.
template <int L>
FT_INLINE void run_tiles(const Call& c, int64_t t0, int64_t t1) {
  const bool few = c.x_chunks == nullptr;
  // NOTE: 64-byte aligned: a 16-byte aligned tile split every weight load over two cache lines
  // and the many-rows loop ran at ~60 % of the fp32 panels' rate.
  thread_local std::vector<float> w_store, acc_store;
  float* w_buf = nullptr;
  float* acc_buf = nullptr;
  if (!few) {
    w_store.resize(kTile * (kChunk + 256) + 16);  // chunk_of < kChunk + a block
    acc_store.resize(static_cast<size_t>(c.M) * kTile * 16 + 16);
    w_buf = aligned64(w_store.data());
    acc_buf = aligned64(acc_store.data());
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = c.tile_n0[t], n1 = c.tile_n1[t];
    switch (c.tile_type[t]) {
#define FT_TYPE_CASE(T)                                               \
  case T:                                                             \
    run_tile<L, T>(c, n0, n1, few, w_buf, acc_buf);               \
    break;
      FT_TYPE_CASE(kF32) FT_TYPE_CASE(kF16) FT_TYPE_CASE(kBF16) FT_TYPE_CASE(kQ8_0)
      FT_TYPE_CASE(kQ4_0) FT_TYPE_CASE(kQ4_1) FT_TYPE_CASE(kQ5_0) FT_TYPE_CASE(kQ5_1)
      FT_TYPE_CASE(kQ2_K) FT_TYPE_CASE(kQ3_K) FT_TYPE_CASE(kQ4_K) FT_TYPE_CASE(kQ5_K)
      FT_TYPE_CASE(kQ6_K) FT_TYPE_CASE(kIQ4_NL) FT_TYPE_CASE(kIQ4_XS)
#undef FT_TYPE_CASE
      default: break;
    }
  }
}

FT_TARGET_AVX512 void run_avx512(const Call& c, int64_t t0, int64_t t1) { run_tiles<16>(c, t0, t1); }
FT_TARGET_AVX2 void run_avx2(const Call& c, int64_t t0, int64_t t1) { run_tiles<8>(c, t0, t1); }
void run_base(const Call& c, int64_t t0, int64_t t1) { run_tiles<4>(c, t0, t1); }

// x [M, K] copied chunk by chunk into out: [chunk c][M][its k]. The micro-kernel reads a row
// group's chunk of x 2 x 16 / NR times, and in x's own layout a chunk's rows lie K apart: every
// row on the same L1 sets (with K a multiple of 1024) and M short streams. NOTE: on a Zen 3,
// 224 rows, this took 0.94x the time, the copy included.
void copy_chunks(const float* x, int64_t M, int64_t K, int64_t chunk, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kc = std::min(chunk, K - k0);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(out + k0 * M + m * kc, x + m * K + k0, kc * sizeof(float));
  }
}

int type_id(const std::string& name) {
  for (int t = 0; t < kNumTypes; ++t)
    if (name == kTypes[t].name) return t;
  return -1;
}

}  // namespace

std::vector<std::string> gguf_matrix_types() {
  std::vector<std::string> out;
  for (const TypeInfo& t : kTypes) out.emplace_back(t.name);
  return out;
}

at::Tensor gguf_matrix_pack(const at::Tensor& base, const at::Tensor& row_offsets,
                            const std::vector<std::string>& types,
                            const std::vector<int64_t>& ends, int64_t K) {
  const int64_t N = gguf_args::check_rows(base, row_offsets, types, ends, "gguf_matrix");
  TORCH_CHECK_VALUE(K >= 16 && K <= INT32_MAX && N <= INT32_MAX, "gguf_matrix: bad K ", K);
  const at::Tensor off = row_offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t nseg = static_cast<int64_t>(types.size());
  at::Tensor out = at::zeros({kHeaderBytes + nseg * 16 + N * 8}, base.options());
  uint8_t* p = out.data_ptr<uint8_t>();
  const int32_t h[5] = {kMagic, kVersion, static_cast<int32_t>(N), static_cast<int32_t>(K),
                        static_cast<int32_t>(nseg)};
  std::memcpy(p, h, sizeof h);
  auto* seg = reinterpret_cast<Segment*>(p + kHeaderBytes);
  auto* rows = reinterpret_cast<const uint8_t**>(p + kHeaderBytes + nseg * 16);
  const uint8_t* b = base.data_ptr<uint8_t>();
  int64_t start = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int t = type_id(types[s]);
    TORCH_CHECK_VALUE(t >= 0, "gguf_matrix: no kernel for GGUF type ", types[s]);
    TORCH_CHECK_VALUE(K % kTypes[t].values == 0, "gguf_matrix: a ", types[s], " row holds a "
                      "multiple of ", kTypes[t].values, " weights, not ", K);
    TORCH_CHECK_VALUE(ends[s] > start && ends[s] <= N, "gguf_matrix: segment ends must rise");
    const int64_t row_bytes = K / kTypes[t].values * kTypes[t].bytes;
    for (int64_t n = start; n < ends[s]; ++n) {
      TORCH_CHECK_VALUE(o[n] >= 0 && o[n] + row_bytes <= base.numel(), "gguf_matrix: row ", n,
                        " at byte ", o[n], " (", row_bytes, " bytes) lies outside base (",
                        base.numel(), " bytes)");
      rows[n] = b + o[n];
    }
    seg[s] = {t, 0, ends[s]};
    start = ends[s];
  }
  return out;
}

std::vector<int64_t> gguf_matrix_shape(const at::Tensor& weight) {
  const Matrix m = read_matrix(weight, "gguf_matrix_shape");
  return {m.N, m.K};
}

bool is_gguf_matrix(const at::Tensor& weight) {
  return gguf_args::has_magic(weight, kMagic, kHeaderBytes);
}

at::Tensor gguf_matrix_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) {
  const Matrix mat = read_matrix(weight, "gguf_linear");
  const float* b = gguf_args::check_call(x, mat.K, mat.N, bias, "gguf_linear");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, mat.N}, x.options());
  if (M == 0) return y;
  // Tiles of kTile outputs, never across a segment.
  std::vector<int64_t> n0s, n1s;
  std::vector<int32_t> types;
  double bytes = 0;
  int64_t start = 0, block = 1;  // block: a multiple of every segment's (all powers of two)
  for (int64_t s = 0; s < mat.nseg; ++s) {
    const Segment& seg = mat.segments[s];
    block = std::max<int64_t>(block, kTypes[seg.type].values);
    for (int64_t n = start; n < seg.end; n += kTile) {
      n0s.push_back(n);
      n1s.push_back(std::min(seg.end, n + kTile));
      types.push_back(seg.type);
    }
    bytes += static_cast<double>(seg.end - start) * mat.K / kTypes[seg.type].values *
             kTypes[seg.type].bytes;
    start = seg.end;
  }
  // The ISA's loop and the most rows its few-rows loop takes (cpuid-checked; follows set_cpu_isa).
  struct Variant {
    void (*run)(const Call&, int64_t, int64_t);
    int few_max;
  };
  const Isa isa = current_isa();
  const Variant var = isa == Isa::kAvx512 ? Variant{&run_avx512, few_rows_max<16>()}
                      : isa == Isa::kAvx2 ? Variant{&run_avx2, few_rows_max<8>()}
                                          : Variant{&run_base, few_rows_max<4>()};
  // One thread's time, roughly: the blocks at ~20 GB/s or the flops at ~80 GFLOP/s.
  const int64_t ntiles = static_cast<int64_t>(n0s.size());
  const double est_ns = std::max(bytes / 20.0, 2.0 * M * mat.N * mat.K / 80.0);
  const int nthreads = est_ns < panel::kInlineNs ? 1 : at::get_num_threads();
  // Tasks: a few contiguous tile ranges per thread (dynamic claiming absorbs a late helper).
  const int64_t n = std::min<int64_t>(nthreads == 1 ? 1 : 4 * nthreads, ntiles);
  // Row blocks of at most kRowBlock rows, each a pass over every tile (the bits do not depend on
  // the rows beside a row). NOTE: it bounds the copy of x and the lane sums (a long prefill's
  // 2048 rows of an 8B ffn_down would copy 117 MB) and keeps a chunk's x and sums in L2.
  thread_local std::vector<float> x_store;  // the calling thread's, reused
  const int64_t chunk = chunk_of(mat.K, block);
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - m0);
    const float* xd = x.data_ptr<float>() + m0 * mat.K;
    const float* x_chunks = nullptr;
    int64_t ldx = mat.K;
    if (rows > var.few_max) {
      x_store.resize(static_cast<size_t>(rows) * mat.K);
      copy_chunks(xd, rows, mat.K, chunk, x_store.data());
      x_chunks = x_store.data();
    } else if (rows > 1) {
      ldx = panel::x_row_stride(mat.K);
      xd = panel::rows_at_stride(xd, rows, mat.K, ldx, x_store);
    }
    const Call c{xd, rows, mat.K, mat.N, ldx, x_chunks, chunk, b,
                 y.data_ptr<float>() + m0 * mat.N, mat.rows, n0s.data(), n1s.data(),
                 types.data()};
    TaskPool::get().run(n, nthreads, [&](int64_t t) {
      var.run(c, ntiles * t / n, ntiles * (t + 1) / n);
    });
  }
  return y;
}

}  // namespace freetoken
