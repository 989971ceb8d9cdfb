// The int8 mode's AMX loop (CPUs with AMX-INT8: Sapphire Rapids and later), for steps of 32 rows
// and more, every int8 format. One tile product (tdpbsud: x's int8 rows times the panel's
// unsigned codes) gives a group's integer sums for 16 rows and the panel's 16 outputs at once:
// the same exact int32 that the VNNI loop's vpdpbusd chains add up. What follows is the VNNI
// loop's own code (int8_vnni.h: a group's fp32 step; a K-quant's scales in integer, then its
// superblock's fp32 step), so the bits are the same.
//
// Why: in the VNNI loop a group's fp32 steps (convert, scale, add; the min's product and add)
// take the same two vector pipes as its 8 vpdpbusd a row, and the loop ran at ~0.3 of the
// vpdpbusd rate (SmolLM2's Q4_1 at 224 rows, Sapphire-Rapids-class Xeon). Here the tile unit
// does the products and the vector pipes only the fp32 steps.
//
// Tiles: tmm0 / tmm1 the sums C [16 rows][16 outputs] int32, tmm2 / tmm3 x A [16 rows][a group's
// 32 int8, Q6_K's 16] (read in place, row stride K), tmm4 / tmm5 the codes B [group / 4][64] (row
// r: codes 4r..4r+3 of each output, the panel's own layout; 4- and 6-bit codes are widened to a
// byte first). Two sets, so that one group's tile product overlaps the previous group's steps.
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

// tmm0-1 C, tmm2-3 A (16 x group bytes), tmm4-5 B (group / 4 x 64) for groups of `group` (32,
// or Q6_K's 16); group 0: the bound loop's 16 x 64 tiles on tmm0-7.
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

// The panel's codes as tdpbsud's B operands, group after group (group / 4 rows of 64 bytes, row
// r: codes 4r..4r+3 of each output): byte codes are read in place (b_tile), 4- and 6-bit codes
// are widened into buf (a group's tile at buf + its index * group * 16), once a call.
// NOTE: widened once for all the rows, not a group at a time: a tile load of bytes stored just
// before waits for them to reach the cache (SmolLM2's Q4_1 at 224 rows: level with the VNNI
// loop, then 1.3x).
template <int KIND>
FT_TARGET_AMX FT_INLINE void widen_codes(const uint8_t* data, int64_t units, uint8_t* buf) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int PER = ki.unit / ki.group;
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t u = 0; u < units; ++u) {
    for (int j = 0; j < PER; ++j) {
      const uint8_t* codes = data + u * unit_bytes(KIND) + head_bytes(KIND) + j * group_bytes(KIND);
      uint8_t* out = buf + (u * PER + j) * ki.group * 16;
      if constexpr (ki.codes == kNib) {
        for (int t = 0; t < 4; ++t) {  // the low nibbles are codes 4t.., the high ones 16 + 4t..
          const __m512i v = _mm512_loadu_si512(codes + 64 * t);
          _mm512_store_si512(out + 64 * t, _mm512_and_si512(v, low4));
          _mm512_store_si512(out + 256 + 64 * t,
                             _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        }
      } else if constexpr (ki.codes == kSix) {
        __m512i v[4];
        six_bit_steps(codes, v);
        for (int t = 0; t < 4; ++t) _mm512_store_si512(out + 64 * t, v[t]);
      }
    }
  }
}

// Group j of unit u's B tile.
template <int KIND>
FT_INLINE const uint8_t* b_tile(const uint8_t* data, const uint8_t* buf, int64_t u, int j) {
  constexpr KindInfo ki = kKinds[KIND];
  if constexpr (ki.codes == kByte)
    return data + u * unit_bytes(KIND) + head_bytes(KIND) + j * group_bytes(KIND);
  return buf + (u * (ki.unit / ki.group) + j) * ki.group * 16;
}

// One group's tile product for 16 rows of x (at xq, row stride K) against the codes tile b, on
// tile set S (store_sums<S> then writes it out).
template <int S>
FT_TARGET_AMX FT_INLINE void group_product(const uint8_t* b, const int8_t* xq, int64_t K) {
  if constexpr (S == 0) {
    FT_TILE_ZERO(0);
    FT_TILE_LOAD(2, xq, K);
    FT_TILE_LOAD(4, b, 64);
    FT_TILE_DPBSUD(0, 2, 4);
  } else {
    FT_TILE_ZERO(1);
    FT_TILE_LOAD(3, xq, K);
    FT_TILE_LOAD(5, b, 64);
    FT_TILE_DPBSUD(1, 3, 5);
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
    if (u < units && u % 2 == 0) group_product<0>(b_tile<KIND>(data, buf, u, 0), xq + 32 * u, x.K);
    if (u < units && u % 2 == 1) group_product<1>(b_tile<KIND>(data, buf, u, 0), xq + 32 * u, x.K);
    if (u == 0) continue;
    if ((u - 1) % 2 == 0) stored_sums<0>(sums[0], P);
    else stored_sums<1>(sums[1], P);
    group_step<kRows, KIND>(data + (u - 1) * unit_bytes(KIND), pi.c, x, m0, u - 1, P, acc);
  }
  alignas(64) float out[kRows * kPanel];
  for (int m = 0; m < kRows; ++m) _mm512_store_ps(out + m * kPanel, acc[m]);
  store_rows(out, kRows, m0, pi, y, N, bias);
}

// Rows [m0, m0 + 16) of a K-quant panel into y: group by group the tile products (pipelined as
// rows_amx's), each group's sums times its integer scales into I, then the superblock's step.
template <int KIND>
FT_TARGET_AMX void rows_amx_k(const uint8_t* data, const uint8_t* buf, const PanelInfo& pi,
                              const Acts& x, int64_t m0, float* y, int64_t N, const float* bias) {
  constexpr int G = kKinds[KIND].group, PER = 256 / G;
  const int64_t units = x.K / 256;
  alignas(64) int32_t sums[2][kRows * kPanel];
  alignas(64) float out[kRows * kPanel];
  for (int m = 0; m < kRows; ++m) _mm512_store_ps(out + m * kPanel, _mm512_setzero_ps());
  const int8_t* xq = x.q + m0 * x.K;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = data + u * unit_bytes(KIND);
    __m512i I[kRows], P[kRows];
    for (int m = 0; m < kRows; ++m) I[m] = _mm512_setzero_si512();
    for (int j = 0; j <= PER; ++j) {
      const int8_t* xg = xq + u * 256 + j * G;
      if (j < PER && j % 2 == 0) group_product<0>(b_tile<KIND>(data, buf, u, j), xg, x.K);
      if (j < PER && j % 2 == 1) group_product<1>(b_tile<KIND>(data, buf, u, j), xg, x.K);
      if (j == 0) continue;
      if ((j - 1) % 2 == 0) stored_sums<0>(sums[0], P);
      else stored_sums<1>(sums[1], P);
      add_scaled<kRows, KIND>(unit, j - 1, P, I);
    }
    superblock_step<kRows, KIND>(unit, pi.c, x, m0, u, I, out);
  }
  store_rows(out, kRows, m0, pi, y, N, bias);
}

template <int KIND>
FT_TARGET_AMX void panel_amx(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M,
                             float* y, int64_t N, const float* bias) {
  constexpr KindInfo ki = kKinds[KIND];
  static const TileConfig config = loop_config(ki.group);
  const int64_t units = x.K / ki.unit, whole = M / kRows * kRows;
  const size_t widened_bytes = ki.codes == kByte ? 0 : units * ki.unit * 16 + 64;
  thread_local std::vector<uint8_t> widened;
  if (widened.size() < widened_bytes) widened.resize(widened_bytes);
  uint8_t* buf = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
  if constexpr (ki.codes != kByte) widen_codes<KIND>(data, units, buf);
  load_config(config);
  for (int64_t m0 = 0; m0 < whole; m0 += kRows) {
    if constexpr (ki.unit == 256) rows_amx_k<KIND>(data, buf, pi, x, m0, y, N, bias);
    else rows_amx<KIND>(data, buf, pi, x, m0, y, N, bias);
  }
  asm volatile("tilerelease" ::: "memory");
  if (whole == M) return;
  // The last rows: the VNNI loop on the rows from `whole` (the same arithmetic per row).
  const int64_t ld32 = x.K / kXBlock;
  const Acts rest{x.q + whole * x.K,       x.d + whole * ld32,    x.s16 + whole * 2 * ld32,
                  x.s32 + whole * ld32,    x.xs32 + whole * ld32, x.K};
  run_panel_vnni(data, pi, rest, M - whole, y + whole * N, N, bias);
}

// Asks Linux once for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
// without it the first tile instruction kills the process.
bool tiles_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace

void run_panel_amx(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                   int64_t N, const float* bias) {
  with_kind(pi.kind, [&](auto kind) {
    panel_amx<decltype(kind)::value>(data, pi, x, M, y, N, bias);
  });
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

void run_panel_amx(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                   int64_t N, const float* bias) {
  panel_portable(data, pi, x, M, y, N, bias);
}
bool cpu_has_amx() { return false; }
void amx_chains(int64_t) {}

#endif

}  // namespace int8
}  // namespace freetoken
