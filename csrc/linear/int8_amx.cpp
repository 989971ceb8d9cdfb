// The int8 mode's AMX loop (CPUs with AMX-INT8: Sapphire Rapids and later), for steps of 32 rows
// and more, every int8 format. Tile products give the exact int32 sums that the VNNI loop's
// vpdpbusd chains add up; what follows is the VNNI loop's own code (int8_vnni.h: a group's fp32
// step, a K-quant superblock's fp32 step), so the bits are the same.
//
// Why: in the VNNI loop the fp32 steps and the integer scales take the same two vector pipes as
// the vpdpbusd, and the loop ran at ~0.3 of the vpdpbusd rate (SmolLM2's Q4_1 at 224 rows,
// Sapphire-Rapids-class Xeon). Here the tile unit does the products and the vector pipes only
// the steps.
//
// 32-value formats (rows_amx): one tile product a group (tdpbsud: 16 rows of x by the group's
// codes; tdpbssd by the codes less their offset where the format has no min), its sums stored
// and stepped in fp32 (the group's scale is an fp16). K-quants
// (panels_amx_k): a group's integer scale goes into its codes once a call (widen_group, as two
// byte planes), so a superblock's 256 values are 4 x 2 full tile products into sums that stay
// in the tiles, and the vector pipes see one store a superblock instead of one a group and no
// vpmulld (two uops on these cores).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "linear/int8_kernels.h"
#include "linear/int8_vnni.h"

namespace freetoken {
namespace int8 {

#if FT_HAS_ISA_VARIANTS && defined(__linux__)
#define FT_TARGET_AMX                                                                       \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,"  \
                        "avx2,fma,f16c")))

namespace {

// The asm of the tile instructions, with a memory clobber on every one (GCC's _tile_loadd has
// none, so a store to the codes buffer could sink below the load that reads it).
#define FT_TILE_LOAD(t, p, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<long>(stride)) : "memory")
#define FT_TILE_STORE(t, p, stride)                                 \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p),        \
               "r"(static_cast<long>(stride))                       \
               : "memory")
#define FT_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define FT_TILE_DPBSUD(c, a, b) \
  asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define FT_TILE_DPBSSD(c, a, b) \
  asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

constexpr int kRows = 16;  // rows a tile product

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-1 C, tmm2-3 A (16 x 32 bytes), tmm4-5 B (8 x 64) for a 32-value format's groups; group 0:
// 16 x 64 tiles on tmm0-7 (the K-quants' loop and the bound loop).
TileConfig loop_config(int group) {
  TileConfig c;
  for (int t = 0; t < (group ? 6 : 8); ++t) {
    c.rows[t] = group && t >= 4 ? group / 4 : kRows;
    c.colsb[t] = group && (t == 2 || t == 3) ? group : 64;
  }
  return c;
}

FT_TARGET_AMX void load_config(const TileConfig& c) {
  asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

// A 32-value format without a min (Q4_0, Q5_0, Q8_0, IQ4_NL) takes its codes less its offset c,
// as signed bytes (tdpbssd): the group's sums are then P - c * S, and its steps take no c * S a
// row (the same int32, so the same bits).
// NOTE: the steps hold this loop, not the tiles; without the scalar c * S and its broadcast a row
// and group, a 1B-shaped 8192 x 2048 at 224 rows took Q8_0 0.83x / 0.80x the time (two threads /
// one), Q4_0 0.87x / 0.94x, IQ4_NL 0.92x / 0.92x; Q5_0 at 64 rows 0.81x / 0.89x; Q8_0 at 32 rows
// (its codes now copied once a call, not read in place) 0.99x / 0.74x.
template <int KIND>
constexpr bool offset_in_codes() {
  return kKinds[KIND].unit == 32 && !has_min(KIND);
}
// Whether a 32-value panel's B tiles are its own bytes (Q5_1's), not widened into a buffer.
template <int KIND>
constexpr bool b_in_place() {
  return kKinds[KIND].codes == kByte && !offset_in_codes<KIND>();
}

// A 32-value panel's codes as the tile products' B operands, group after group (8 rows of 64
// bytes, row r: codes 4r..4r+3 of each output), widened into buf (group u's tile at buf + u *
// 512) once a call: 4-bit codes unpacked (IQ4's looked up), less c where offset_in_codes.
// NOTE: widened once for all the rows, not a group at a time: a tile load of bytes stored just
// before waits for them to reach the cache (SmolLM2's Q4_1 at 224 rows: level with the VNNI
// loop, then 1.3x).
template <int KIND>
FT_TARGET_AMX FT_INLINE void widen_codes(const uint8_t* data, int64_t units, int32_t c,
                                         uint8_t* buf) {
  static_assert(kKinds[KIND].unit == 32 && !b_in_place<KIND>());
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(offset_in_codes<KIND>() ? c : 0));
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* codes = data + u * unit_bytes(KIND);
    uint8_t* out = buf + u * 512;
    if constexpr (kKinds[KIND].codes == kByte) {
      for (int t = 0; t < 8; ++t)
        _mm512_store_si512(out + 64 * t,
                           _mm512_sub_epi8(_mm512_loadu_si512(codes + 64 * t), offset));
      continue;
    }
    for (int t = 0; t < 4; ++t) {  // the low nibbles are codes 4t.., the high ones 16 + 4t..
      const __m512i v = _mm512_loadu_si512(codes + 64 * t);
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (kKinds[KIND].codes == kLut) {
        lo = _mm512_shuffle_epi8(iq4_codes512(), lo);
        hi = _mm512_shuffle_epi8(iq4_codes512(), hi);
      }
      _mm512_store_si512(out + 64 * t, _mm512_sub_epi8(lo, offset));
      _mm512_store_si512(out + 256 + 64 * t, _mm512_sub_epi8(hi, offset));
    }
  }
}

// Group u's B tile (a 32-value panel).
template <int KIND>
FT_INLINE const uint8_t* b_tile(const uint8_t* data, const uint8_t* buf, int64_t u) {
  if constexpr (b_in_place<KIND>()) return data + u * unit_bytes(KIND);
  return buf + u * 512;
}

// One group's tile product for 16 rows of x (at xq, row stride K) against the codes tile b, on
// tile set S (store_sums<S> then writes it out); SIGNED: b's codes are signed bytes.
template <int S, bool SIGNED>
FT_TARGET_AMX FT_INLINE void group_product(const uint8_t* b, const int8_t* xq, int64_t K) {
  if constexpr (S == 0) {
    FT_TILE_ZERO(0);
    FT_TILE_LOAD(2, xq, K);
    FT_TILE_LOAD(4, b, 64);
    if constexpr (SIGNED) FT_TILE_DPBSSD(0, 2, 4);
    else FT_TILE_DPBSUD(0, 2, 4);
  } else {
    FT_TILE_ZERO(1);
    FT_TILE_LOAD(3, xq, K);
    FT_TILE_LOAD(5, b, 64);
    if constexpr (SIGNED) FT_TILE_DPBSSD(1, 3, 5);
    else FT_TILE_DPBSUD(1, 3, 5);
  }
}

// Tile set S's sums into sums (int32 [16][16]).
template <int S>
FT_TARGET_AMX FT_INLINE void store_sums(int32_t* sums) {
  if constexpr (S == 0) FT_TILE_STORE(0, sums, 64);
  else FT_TILE_STORE(1, sums, 64);
}

// Group j's sums for 16 rows from tile set S's product (stored to sums), as registers.
template <int S>
FT_TARGET_AMX FT_INLINE void stored_sums(int32_t* sums, __m512i (&P)[kRows]) {
  store_sums<S>(sums);
  for (int m = 0; m < kRows; ++m) P[m] = _mm512_load_si512(sums + m * kPanel);
}

// Where a panel's rows go: y's columns [pi.n0, pi.n1). The last range of K (final) adds the
// bias (or + 0, as store_rows in int8_kernels.h); a range before it leaves its sums there as they
// are, for the next range (start_rows).
struct PanelOut {
  PanelInfo pi;
  float* y;
  int64_t N;
  const float* bias;
  bool final;
  int64_t M;  // y's rows (the AMX loop's last tile may run past them)
};

// Rows [m0, m0 + R) of a panel's sums (acc [R][16]) into y, one masked store a row. NOTE: GCC
// left store_rows scalar here, 16 stores a row of y N floats apart (a 1B-shaped Q4_K 8192 x 2048
// at 224 rows, one thread: 0.91-0.97x the time with these).
template <int R>
FT_TARGET_AMX FT_INLINE void write_rows(const float* acc, int64_t m0, const PanelOut& o) {
  const int64_t n0 = o.pi.n0;
  const __mmask16 lanes = static_cast<__mmask16>((1u << (o.pi.n1 - n0)) - 1);
  const __m512 b = o.bias ? _mm512_maskz_loadu_ps(lanes, o.bias + n0) : _mm512_setzero_ps();
  float* row = o.y + m0 * o.N + n0;
  for (int m = 0; m < R && m0 + m < o.M; ++m, row += o.N) {
    const __m512 v = _mm512_load_ps(acc + m * kPanel);
    _mm512_mask_storeu_ps(row, lanes, o.final ? _mm512_add_ps(v, b) : v);
  }
}

// The accumulators of rows [0, whole) as a panel starts: zeros, or from y's rows the sums that
// the range of K before left there (resume: zeros past M and past the panel's outputs).
// NOTE: masked vector loads, not a memcpy a row (a call to memmove: 0.85 % of the 1B
// int8 server's classify samples).
FT_TARGET_AMX FT_INLINE void start_rows(float* acc, int64_t whole, bool resume,
                                        const PanelOut& o) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << (o.pi.n1 - o.pi.n0)) - 1);
  const float* row = o.y + o.pi.n0;
  for (int64_t m = 0; m < whole; ++m, row += o.N)
    _mm512_store_ps(acc + m * kPanel, resume && m < o.M ? _mm512_maskz_loadu_ps(lanes, row)
                                                        : _mm512_setzero_ps());
}

// Rows [m0, m0 + 16) of a 32-value panel into y, its B tiles from widen_codes' buf. Group u's
// product goes out before group u - 1's fp32 step, on the other tile set.
// A group's sums are stored one group later, just before its step, so that the store does not
// wait on the product just issued (measured level with storing at once, SmolLM2's Q4_1).
template <int KIND>
FT_TARGET_AMX void rows_amx(const uint8_t* data, const uint8_t* buf, const PanelInfo& pi,
                            const Acts& x, int64_t m0, float* y, int64_t N, const float* bias) {
  const int64_t units = x.K / 32;
  alignas(64) int32_t sums[2][kRows * kPanel];
  __m512 acc[kRows];
  __m512i P[kRows];
  for (int m = 0; m < kRows; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* xq = x.q + m0 * x.K;
  for (int64_t u = 0; u <= units; ++u) {
    constexpr bool SIGNED = offset_in_codes<KIND>();
    const uint8_t* b = b_tile<KIND>(data, buf, u);
    if (u < units && u % 2 == 0) group_product<0, SIGNED>(b, xq + 32 * u, x.K);
    if (u < units && u % 2 == 1) group_product<1, SIGNED>(b, xq + 32 * u, x.K);
    if (u == 0) continue;
    if ((u - 1) % 2 == 0) stored_sums<0>(sums[0], P);
    else stored_sums<1>(sums[1], P);
    group_step<kRows, KIND, SIGNED>(data + (u - 1) * unit_bytes(KIND), pi.c, x, m0, u - 1, P,
                                    acc);
  }
  alignas(64) float out[kRows * kPanel];
  for (int m = 0; m < kRows; ++m) _mm512_store_ps(out + m * kPanel, acc[m]);
  write_rows<kRows>(out, m0, {pi, y, N, bias, true, m0 + kRows});
}

// A K-quant group's codes times its integer scales, as tile operands. A product code * sc fits
// 16 bits (Q4_K / Q5_K: 0..1953; Q2_K 0..45; the offset kinds (codes - c) * sc: Q6_K
// -4064..4096, Q3_K -128..128, IQ4_XS -4064..4064), not 8: its low byte
// (unsigned) goes to lo, its high byte (signed) to hi, and codes . x times sc = (lo . x) + 256
// (hi . x), the same int32 as the VNNI loop's add_scaled (Q6_K: less c * sc times x's sums, the
// offset that the VNNI loop's step takes off). Per 64 codes: two vpmaddubsw (even and odd bytes
// against the output's sc), Q6_K two vpsubw, and two byte merges, once a call for every row.
// NOTE: Q6_K's offset in the codes, not in the step: the step's 8 vpdpwssd a row (c * sc . x's
// sums of 16) go: a 1B-shaped Q6_K 2048 x 8192 at 224 rows 0.65x / 0.70x the time (two threads
// / one); an 8B-shaped 4096 x 14336 0.75x of the loop before the y stores above, both together.
// Group j of the superblock at unit goes to lo / hi + j * group * 16 (G / 4 rows of 64 bytes, row
// r: codes 4r..4r+3 of each output), so the superblock's 256 values are 4 tiles of 16 rows at
// lo / hi + c * 1024.
template <int KIND>
FT_TARGET_AMX FT_INLINE void widen_group(const uint8_t* unit, int j, int32_t c, uint8_t* lo,
                                         uint8_t* hi) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int ROWS = ki.group / 4;
  const __m512i low4 = _mm512_set1_epi8(15), low_byte = _mm512_set1_epi16(0x00FF);
  const uint8_t* codes = unit + head_bytes(KIND) + j * group_bytes(KIND);
  __m512i v[8];  // row-blocks of 64 bytes (4 codes an output), in B-tile order
  if constexpr (ki.codes == kNib || ki.codes == kLut) {
    for (int t = 0; t < 4; ++t) {
      const __m512i n = _mm512_loadu_si512(codes + 64 * t);
      v[t] = _mm512_and_si512(n, low4);
      v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low4);
      if constexpr (ki.codes == kLut) {
        v[t] = _mm512_shuffle_epi8(iq4_codes512(), v[t]);
        v[t + 4] = _mm512_shuffle_epi8(iq4_codes512(), v[t + 4]);
      }
    }
  } else if constexpr (ki.codes == kSix || ki.codes == kTwo || ki.codes == kThree) {
    __m512i s[4];
    if constexpr (ki.codes == kSix) six_bit_steps(codes, s);
    else low_bit_steps<ki.codes>(codes, s);
    for (int t = 0; t < 4; ++t) v[t] = s[t];
  } else {
    for (int t = 0; t < ROWS; ++t) v[t] = _mm512_loadu_si512(codes + 64 * t);
  }
  // Output o's sc in bytes 4 o and 4 o + 2 (even), 4 o + 1 and 4 o + 3 (odd).
  const __m512i sc = _mm512_maskz_cvtepu8_epi32(
      0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + sc_offset(KIND) + 16 * j)));
  const __m512i even = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
  const __m512i odd = _mm512_slli_epi32(even, 8);
  // Q6_K: c * sc (its sc signed) in both int16 of the output's lane
  __m512i offset = _mm512_setzero_si512();
  if constexpr (ki.scales == kK6) {
    const __m512i cs = _mm512_mullo_epi32(
        _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                               unit + sc_offset(KIND) + 16 * j))),
        _mm512_set1_epi32(c));
    offset = _mm512_or_si512(_mm512_and_si512(cs, _mm512_set1_epi32(0xFFFF)),
                             _mm512_slli_epi32(cs, 16));
  }
  lo += j * ki.group * 16;
  hi += j * ki.group * 16;
  for (int t = 0; t < ROWS; ++t) {
    __m512i pe = _mm512_maddubs_epi16(v[t], even), po = _mm512_maddubs_epi16(v[t], odd);
    if constexpr (ki.scales == kK6) {
      pe = _mm512_sub_epi16(pe, offset);
      po = _mm512_sub_epi16(po, offset);
    }
    // 0xCA: a ? b : c, bit by bit (a = the low byte of each 16-bit lane)
    _mm512_store_si512(lo + 64 * t,
                       _mm512_ternarylogic_epi32(low_byte, pe, _mm512_slli_epi16(po, 8), 0xCA));
    _mm512_store_si512(hi + 64 * t,
                       _mm512_ternarylogic_epi32(low_byte, _mm512_srli_epi16(pe, 8), po, 0xCA));
  }
}

// Chunk c of a superblock's tile products (64 of its values) for RT tiles of 16 rows: x's tiles
// at a (Acts::qa; the next row tile `next` bytes on) against the scaled codes' tiles at lo, hi.
// Tiles: tmm0-3 C (lo, hi of row tile 0, then of row tile 1), tmm4-5 x, tmm6-7 lo / hi codes.
template <int RT>
FT_TARGET_AMX FT_INLINE void chunk_products(const uint8_t* lo, const uint8_t* hi, const int8_t* a,
                                            int64_t next) {
  FT_TILE_LOAD(4, a, 64);
  if constexpr (RT == 2) FT_TILE_LOAD(5, a + next, 64);
  FT_TILE_LOAD(6, lo, 64);
  FT_TILE_LOAD(7, hi, 64);
  FT_TILE_DPBSUD(0, 4, 6);
  FT_TILE_DPBSSD(1, 4, 7);
  if constexpr (RT == 2) {
    FT_TILE_DPBSUD(2, 5, 6);
    FT_TILE_DPBSSD(3, 5, 7);
  }
}

// The C tiles (row tile r: sums[r][0] lo, sums[r][1] hi), zeroed or stored.
template <int RT>
FT_TARGET_AMX FT_INLINE void zero_c() {
  FT_TILE_ZERO(0);
  FT_TILE_ZERO(1);
  if constexpr (RT == 2) {
    FT_TILE_ZERO(2);
    FT_TILE_ZERO(3);
  }
}
template <int RT>
FT_TARGET_AMX FT_INLINE void store_c(int32_t (*sums)[2][kRows * kPanel]) {
  FT_TILE_STORE(0, sums[0][0], 64);
  FT_TILE_STORE(1, sums[0][1], 64);
  if constexpr (RT == 2) {
    FT_TILE_STORE(2, sums[1][0], 64);
    FT_TILE_STORE(3, sums[1][1], 64);
  }
}

// Rows [m0, m0 + MR) of superblock u's step, its sums lo + 256 hi (rows' sums at lo, hi).
template <int MR, int KIND>
FT_TARGET_AMX FT_INLINE void scaled_step(const uint8_t* unit, int32_t c, const Acts& x,
                                         int64_t m0, int64_t u, const int32_t* lo,
                                         const int32_t* hi, float* out) {
  __m512i I[MR];
  for (int m = 0; m < MR; ++m)
    I[m] = _mm512_add_epi32(_mm512_load_si512(lo + m * kPanel),
                            _mm512_slli_epi32(_mm512_load_si512(hi + m * kPanel), 8));
  const int64_t units = x.K / 256;
  if constexpr (kKinds[KIND].scales == kK4 && kKinds[KIND].group == 16) {
    // Q2_K's mins read x's sums of 16, which Acts::sd does not hold: from the row arrays, whose
    // d and s16 hold whole tiles of 16 rows (empty_acts in int8_linear.cpp)
    superblock_step<MR, KIND, true>(unit, c, RowsX(x, m0, u, false), I, out);
  } else {
    const PackedRowsX rows{x.sd + ((m0 / kRows * units + u) * kRows + m0 % kRows) * kSdRowBytes};
    superblock_step<MR, KIND, true>(unit, c, rows, I, out);
  }
}

// A K-quant panel's steps still to do: superblock u's, for RT row tiles from row m0, their sums
// at sums; last: the range's last superblock (its rows then go to y); fetch_y: two before it
// (its rows' lines of y are fetched for writing). NOTE: flags set once a job, not derived from u
// and the range's end in pending_part: derived there, 232 rows of a 1B-shaped Q4_K 8192 x 2048
// took 1.1x the time (two threads).
struct Pending {
  const uint8_t* unit = nullptr;  // nullptr: none
  int64_t u = 0, m0 = 0;
  int rt = 0;
  bool last = false, fetch_y = false;
  const int32_t (*sums)[2][kRows * kPanel] = nullptr;
  float* out = nullptr;  // its panel's accumulators (row m at out + m * kPanel), and y
  const PanelOut* o = nullptr;
};

// Piece c (of 4) of a pending superblock's steps: a quarter of its rows (PART = 4 RT), into out
// (the panel's accumulators, row m at out + m * kPanel), and after the range's last superblock
// into y.
// NOTE: y's rows a piece at a time, their lines fetched two superblocks before, not the panel's
// rows after its last step: those stores (a line of y each, 7 MB of lines for a 1B-shaped
// 8192 x 2048 at 224 rows) missed the cache together and filled the store buffer while the tiles
// waited. Spread and fetched: 0.89x / 0.91x the time (two threads / one) for that matrix, 0.95x
// for 2048 x 8192 (spread alone: slower, 1.08-1.11x; streaming stores: level with fetching, but y
// then leaves the cache that the next op reads it from).
template <int KIND, int PART>
FT_TARGET_AMX FT_INLINE void pending_part(const Pending& p, int c, const Acts& x) {
  const int r = c * PART / kRows, mr = c * PART % kRows;
  const int64_t m = p.m0 + kRows * r + mr;
  const PanelOut& o = *p.o;
  float* out = p.out;
  scaled_step<PART, KIND>(p.unit, o.pi.c, x, m, p.u, p.sums[r][0] + mr * kPanel,
                          p.sums[r][1] + mr * kPanel, out + m * kPanel);
  if (p.last) write_rows<PART>(out + m * kPanel, m, o);
  if (p.fetch_y)
    for (int i = 0; i < PART && m + i < o.M; ++i) _m_prefetchw(o.y + (m + i) * o.N + o.pi.n0);
}
template <int KIND>
FT_TARGET_AMX FT_INLINE void pending_piece(const Pending& p, int c, const Acts& x) {
  if (p.rt == 2) pending_part<KIND, 8>(p, c, x);
  else pending_part<KIND, 4>(p, c, x);
}

// The next superblock's widening, spread over the current one's chunks: `per_chunk` groups after
// each, from `group` on, into lo / hi (unit: nullptr after the last superblock).
struct NextWidening {
  const uint8_t* unit;
  int32_t c;
  int per_chunk, group;
  uint8_t *lo, *hi;
  // The superblock after it (and past the panel's last, the next panel's first): its bytes
  // from fetch to end asked for, two lines after each chunk.
  // NOTE: the steps' blocks come from DRAM, not L3 (a 1B-shaped Q4_K 8192 x 2048 at 224 rows
  // over 64 copies: 1.04x the time of one hot copy); asked for a superblock ahead 0.95-0.96x
  // the time (one thread, two), one hot copy level.
  const uint8_t *fetch, *end;
};

// One superblock's tile products for RT row tiles from row m0 (x's tiles from Acts::qa; its
// scaled codes at lo, hi), with the vector pipes' work spread between its 4 chunks: the pending
// steps (a quarter after each) and some of the next superblock's widening.
template <int KIND, int RT>
FT_TARGET_AMX FT_INLINE void products_job(const uint8_t* lo, const uint8_t* hi, const Acts& x,
                                          int64_t m0, int64_t u, const Pending& pending,
                                          NextWidening& widening,
                                          int32_t (*sums)[2][kRows * kPanel]) {
  constexpr int PER = 256 / kKinds[KIND].group;
  const int64_t next = x.K / 64 * 1024;  // bytes of qa a row tile
  const int8_t* a = x.qa + m0 / kRows * next + u * 4096;
  zero_c<RT>();
  for (int c = 0; c < 4; ++c) {
    chunk_products<RT>(lo + c * 1024, hi + c * 1024, a + c * 1024, next);
    if (pending.unit) pending_piece<KIND>(pending, c, x);
    for (int g = 0; widening.unit && g < widening.per_chunk && widening.group < PER; ++g)
      widen_group<KIND>(widening.unit, widening.group++, widening.c, widening.lo, widening.hi);
    for (int l = 0; l < 2 && widening.fetch < widening.end; ++l, widening.fetch += 64)
      _mm_prefetch(reinterpret_cast<const char*>(widening.fetch), _MM_HINT_T0);
  }
  store_c<RT>(sums);
}

// NP K-quant panels of one format (pis[0..NP), NP = 1 or 2), their whole row tiles [0, whole),
// superblocks [u0, u1), into y (from u0 > 0 the accumulators start from y, where the range
// before left them). Superblock by superblock (each panel's scaled codes widened once, 8 KB that
// stay in L1 for every row), pairs of row tiles (and one alone last) take its tile products 64
// values at a time, panel after panel; between those chunks the vector pipes do the previous
// job's steps (its sums from the other half of sums, its panel's accumulators) and widen the
// panel's next superblock.
// NOTE: two panels a pass, so that the second reads the row tiles' x (Acts::qa) from L1 where
// the first brought it from L2. Against one at a time, 224 rows (scripts/ab_kernel.py, two
// threads / one): 1B-shaped Q4_K 16384 x 2048 0.94x / 0.95x the time, Q6_K 2048 x 8192 0.94x /
// 0.94x, Q4_K 2048 x 8192 0.99x / 0.98x, 3072 x 2048 level; served 1B int8 classify 1.04x the
// requests a second (scripts/ab_serve.py, 4 reps). Widening the next superblock in the last jobs
// rather than the first: 1.04-1.09x the time (its bursts of vector work stall the tiles).
// NOTE: interleaved so, because the tile registers are not renamed: a chunk's tile loads wait
// for the previous chunk's products, and the work between them keeps the vector pipes busy
// meanwhile. A pair's products for a superblock, then its steps whole: 1.07x the time for a
// 1B-shaped Q4_K 8192 x 2048 at 224 rows, 1.13x for 2048 x 8192 (one thread).
template <int KIND, int NP>
FT_TARGET_AMX void panels_amx_k(const uint8_t* base, const PanelInfo* pis, const Acts& x,
                                int64_t whole, int64_t M, int64_t u0, int64_t u1, float* y,
                                int64_t N, const float* bias) {
  constexpr int PER = 256 / kKinds[KIND].group;
  const int64_t units = x.K / 256, tiles = whole / kRows, jobs = (tiles + 1) / 2;
  if (tiles == 0) return;
  const int per_chunk = static_cast<int>((PER + 4 * jobs - 1) / (4 * jobs));
  alignas(64) uint8_t planes[NP][2][2][4096];  // panel q's superblock u: planes[q][u % 2]
  alignas(64) int32_t sums[2][2][2][kRows * kPanel];
  thread_local std::vector<float> acc;
  const int64_t acc_floats = NP * whole * kPanel + 16;
  if (acc.size() < static_cast<size_t>(acc_floats)) acc.resize(acc_floats);
  float* out0 = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(acc.data()) + 63) & ~uintptr_t{63});
  const uint8_t* data[NP];
  float* out[NP];
  PanelOut o[NP];
  for (int q = 0; q < NP; ++q) {
    data[q] = base + pis[q].offset;
    out[q] = out0 + q * whole * kPanel;
    o[q] = {pis[q], y, N, bias, u1 == units, M};
    start_rows(out[q], whole, u0 > 0, o[q]);
    for (int j = 0; j < PER; ++j)
      widen_group<KIND>(data[q] + u0 * unit_bytes(KIND), j, pis[q].c, planes[q][u0 % 2][0],
                        planes[q][u0 % 2][1]);
  }
  Pending pending;
  int half = 0;
  for (int64_t u = u0; u < u1; ++u) {
    NextWidening widening[NP];
    for (int q = 0; q < NP; ++q) {
      const uint8_t* after_next = data[q] + (u + 2) * unit_bytes(KIND);
      widening[q] = {u + 1 < u1 ? data[q] + (u + 1) * unit_bytes(KIND) : nullptr,
                     pis[q].c,
                     per_chunk,
                     0,
                     planes[q][(u + 1) % 2][0],
                     planes[q][(u + 1) % 2][1],
                     after_next,
                     after_next + unit_bytes(KIND)};
    }
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t m0 = 2 * kRows * job;
      const int rt = 2 * job + 1 < tiles ? 2 : 1;
      for (int q = 0; q < NP; ++q) {
        const uint8_t *lo = planes[q][u % 2][0], *hi = planes[q][u % 2][1];
        if (rt == 2)
          products_job<KIND, 2>(lo, hi, x, m0, u, pending, widening[q], sums[half]);
        else
          products_job<KIND, 1>(lo, hi, x, m0, u, pending, widening[q], sums[half]);
        pending = {data[q] + u * unit_bytes(KIND), u, m0, rt, u + 1 == u1, u + 3 == u1,
                   sums[half], out[q], &o[q]};
        half ^= 1;
      }
    }
  }
  for (int c = 0; c < 4; ++c) pending_piece<KIND>(pending, c, x);
}

// Rows [0, M) against a panel, K's superblocks [u0, u1) (of 256 values; u1 * 256 >= K: the
// last range). A 32-value format's panel takes all of K with the first range. The tile config
// for KIND is loaded (run_panels_amx).
template <int KIND>
FT_TARGET_AMX void panel_amx(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M,
                             int64_t u0, int64_t u1, float* y, int64_t N, const float* bias) {
  constexpr KindInfo ki = kKinds[KIND];
  // K-quants: the rows of x's tile copy (Acts::qa_rows), maybe one tile past M
  const int64_t units = x.K / ki.unit, whole = ki.unit == 256 ? x.qa_rows : M / kRows * kRows;
  if constexpr (ki.unit == 256) {
    panels_amx_k<KIND, 1>(data - pi.offset, &pi, x, whole, M, u0, u1, y, N, bias);
  } else if (u0 == 0) {
    const size_t widened_bytes = b_in_place<KIND>() ? 0 : units * 512 + 64;
    thread_local std::vector<uint8_t> widened;
    if (widened.size() < widened_bytes) widened.resize(widened_bytes);
    uint8_t* buf = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
    if constexpr (!b_in_place<KIND>()) widen_codes<KIND>(data, units, pi.c, buf);
    for (int64_t m0 = 0; m0 < whole; m0 += kRows) rows_amx<KIND>(data, buf, pi, x, m0, y, N, bias);
  }
  if (whole >= M || u1 * 256 < x.K) return;
  // The last rows: the VNNI loop on the rows from `whole` (the same arithmetic per row), all of
  // K, once (with the last range).
  const int64_t ld32 = x.K / kXBlock;
  const Acts rest{x.q + whole * x.K,       x.d + whole * ld32,    x.s16 + whole * 2 * ld32,
                  x.s32 + whole * ld32,    x.xs32 + whole * ld32, x.K};
  run_panel_vnni(data, pi, rest, M - whole, y + whole * N, N, bias);
}

// The tile config a format's loop runs on: K-quants 16 x 64 tiles throughout (panels_amx_k), the
// 32-value formats a group's tiles.
template <int KIND>
const TileConfig& kind_config() {
  static const TileConfig config = loop_config(kKinds[KIND].unit == 256 ? 0 : kKinds[KIND].group);
  return config;
}

// Asks Linux once for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
// without it the first tile instruction kills the process.
bool tiles_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace

// NOTE: one ldtilecfg a task, not one a panel: it waits for the tile unit to drain (a 1B-shaped
// Q4_K 8192 x 2048 at 224 rows, one thread: 6 % of the loop's samples on it, a panel at a time).
// Released at the end, so the pool's idle threads hold no tile state (and another library's
// tile code on this thread loads its own config).
void run_panels_amx(const uint8_t* base, const PanelInfo* panels, int64_t p0, int64_t p1,
                    const Acts& x, int64_t M, int64_t u0, int64_t u1, float* y, int64_t N,
                    const float* bias) {
  const TileConfig* loaded = nullptr;
  for (int64_t p = p0; p < p1;) {
    const PanelInfo& pi = panels[p];
    int64_t step = 1;
    with_kind(pi.kind, [&](auto kind) {
      constexpr int KIND = decltype(kind)::value;
      const TileConfig& config = kind_config<KIND>();
      if (loaded != &config) load_config(config);
      loaded = &config;
      if constexpr (kKinds[KIND].unit == 256) {  // panels two at a time (panels_amx_k)
        if (p + 1 < p1 && panels[p + 1].kind == pi.kind) {
          panels_amx_k<KIND, 2>(base, panels + p, x, x.qa_rows, M, u0, u1, y, N, bias);
          step = 2;
          return;
        }
      }
      panel_amx<KIND>(base + pi.offset, pi, x, M, u0, u1, y, N, bias);
    });
    p += step;
  }
  if (loaded) asm volatile("tilerelease" ::: "memory");
}

bool cpu_has_amx() {
  static const bool has = [] {
    unsigned a, b, c, d;
    if (!cpu_has_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), i8 = d & (1u << 25);
    return tile && i8 && tiles_permitted();
  }();
  return has;
}

FT_TARGET_AMX void amx_chains(int64_t iters) {
  static const TileConfig config = loop_config(0);
  alignas(64) static const int8_t zeros[kRows * 64] = {};
  load_config(config);
  FT_TILE_LOAD(4, zeros, 64);
  FT_TILE_LOAD(5, zeros, 64);
  FT_TILE_ZERO(0);
  FT_TILE_ZERO(1);
  FT_TILE_ZERO(2);
  FT_TILE_ZERO(3);
  for (int64_t i = 0; i < iters; ++i) {
    FT_TILE_DPBSSD(0, 4, 5);
    FT_TILE_DPBSSD(1, 4, 5);
    FT_TILE_DPBSSD(2, 4, 5);
    FT_TILE_DPBSSD(3, 4, 5);
  }
  asm volatile("tilerelease" ::: "memory");
}

#else

void run_panels_amx(const uint8_t* base, const PanelInfo* panels, int64_t p0, int64_t p1,
                    const Acts& x, int64_t M, int64_t, int64_t, float* y, int64_t N,
                    const float* bias) {
  for (int64_t p = p0; p < p1; ++p)
    panel_portable(base + panels[p].offset, panels[p], x, M, y, N, bias);
}
bool cpu_has_amx() { return false; }
void amx_chains(int64_t) {}

#endif

}  // namespace int8
}  // namespace freetoken
