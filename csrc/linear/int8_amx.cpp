// The int8 mode's AMX loop (CPUs with AMX-INT8: Sapphire Rapids and later), for the panels of the
// 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) from 32 rows up. One tile product (tdpbsud:
// x's int8 rows times the panel's unsigned codes) gives a group's integer sums for 16 rows and
// the panel's 16 outputs at once: the same exact int32 that the VNNI loop's vpdpbusd chains add
// up. The fp32 steps that follow are the VNNI loop's, in its order, so the bits are the same.
//
// Why: in the VNNI loop a group's fp32 steps (convert, scale, add; the min's product and add)
// take the same two vector pipes as its 8 vpdpbusd a row, and the loop ran at ~0.3 of the
// vpdpbusd rate (SmolLM2's Q4_1 at 224 rows, Sapphire-Rapids-class Xeon). Here the tile unit
// does the products and the vector pipes only the fp32 steps.
//
// Tiles: tmm0 / tmm1 the sums C [16 rows][16 outputs] int32, tmm2 / tmm3 x A [16 rows][32 int8]
// (read in place, row stride K), tmm4 / tmm5 the codes B [8][64] (row r: codes 4r..4r+3 of each
// output, the panel's own layout; 4-bit codes are widened to a byte first). Two sets, so that
// one group's tile product overlaps the previous group's fp32 steps.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "linear/int8_kernels.h"

namespace freetoken {
namespace int8 {

#if FT_HAS_ISA_VARIANTS && defined(__linux__)
#define FT_TARGET_AMX                                                                       \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma," \
                        "f16c")))

namespace {

// The asm of the tile instructions, with a memory clobber on every one (GCC's _tile_loadd has
// none, so a store to the codes buffer could sink below the load that reads it).
#define FT_TILE_LOAD(t, p, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<long>(stride)) : "memory")
#define FT_TILE_STORE(t, p, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(static_cast<long>(stride)) : "memory")
#define FT_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define FT_TILE_DPBSUD(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define FT_TILE_DPBSSD(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

constexpr int kRows = 16;  // rows a tile product

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-1 C, tmm2-3 A, tmm4-5 B (the module comment); the bound loop's 16 x 64 tiles on tmm0-7.
TileConfig loop_config(bool bound) {
  TileConfig c;
  for (int t = 0; t < (bound ? 8 : 6); ++t) {
    c.rows[t] = !bound && t >= 4 ? 8 : kRows;
    c.colsb[t] = !bound && (t == 2 || t == 3) ? 32 : 64;
  }
  return c;
}

FT_TARGET_AMX void load_config(const TileConfig& c) {
  asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

FT_TARGET_AMX FT_INLINE __m512 no_contract512(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

FT_TARGET_AMX FT_INLINE __m512 halfs16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The panel's codes as tdpbsud's B operands, a group's 8 x 64 bytes after another: the panel
// itself for byte codes, else its 4-bit codes widened into buf (units * 512 bytes), once a call.
// NOTE: widened once for all the rows, not a group at a time: a tile load of bytes stored just
// before waits for them to reach the cache.
template <int KIND>
FT_TARGET_AMX FT_INLINE const uint8_t* codes_tiles(const uint8_t* data, int64_t units,
                                                   uint8_t* buf) {
  if constexpr (kKinds[KIND].codes == kByte) {
    return data;
  } else {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* codes = data + u * unit_bytes(KIND);
      uint8_t* out = buf + 512 * u;
      for (int t = 0; t < 4; ++t) {  // the low nibbles are codes 4t.., the high ones 16 + 4t..
        const __m512i v = _mm512_loadu_si512(codes + 64 * t);
        _mm512_store_si512(out + 64 * t, _mm512_and_si512(v, low4));
        _mm512_store_si512(out + 256 + 64 * t, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      }
    }
    return buf;
  }
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

// Group u's fp32 steps for rows [m0, m0 + 16), from its tile product's sums: panel_rows_vnni's.
template <int KIND>
FT_TARGET_AMX FT_INLINE void group_steps(const uint8_t* data, int32_t c, const Acts& x, int64_t m0,
                                         int64_t u, const int32_t* sums, __m512 (&acc)[kRows]) {
  const int64_t ld32 = x.K / kXBlock;
  const uint8_t* codes = data + u * unit_bytes(KIND);
  const __m512 a = halfs16(codes + code_bytes(KIND));
  __m512 b = _mm512_setzero_ps();
  if constexpr (has_min(KIND)) b = halfs16(codes + code_bytes(KIND) + 32);
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    const int64_t xb = (m0 + m) * ld32 + u;
    __m512i P = _mm512_load_si512(sums + m * kPanel);
    if constexpr (!has_min(KIND)) P = _mm512_sub_epi32(P, _mm512_set1_epi32(c * x.s32[xb]));
    const __m512 t = no_contract512(_mm512_mul_ps(a, _mm512_set1_ps(x.d[xb])));
    acc[m] = _mm512_add_ps(acc[m], no_contract512(_mm512_mul_ps(_mm512_cvtepi32_ps(P), t)));
    if constexpr (has_min(KIND))
      acc[m] = _mm512_add_ps(acc[m], no_contract512(_mm512_mul_ps(b, _mm512_set1_ps(x.xs32[xb]))));
  }
}

// Rows [m0, m0 + 16) against one panel into y, its codes tiles at b (codes_tiles). Group u's
// product goes out before group u - 1's fp32 steps, on the other tile set.
template <int KIND>
FT_TARGET_AMX void rows_amx(const uint8_t* data, const uint8_t* b, const PanelInfo& pi,
                            const Acts& x, int64_t m0, float* y, int64_t N, const float* bias) {
  const int64_t units = x.K / 32, b_stride = kKinds[KIND].codes == kByte ? unit_bytes(KIND) : 512;
  alignas(64) int32_t sums[2][kRows * kPanel];
  __m512 acc[kRows];
  for (int m = 0; m < kRows; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* xq = x.q + m0 * x.K;
  // NOTE: a group's sums are stored one group later, just before its fp32 steps: stored right
  // after its product, the store waited for the product and held up the steps behind it.
  for (int64_t u = 0; u < units; ++u) {
    if (u % 2 == 0) {
      group_product<0>(b + u * b_stride, xq + 32 * u, x.K);
      if (u > 0) store_sums<1>(sums[1]);
    } else {
      group_product<1>(b + u * b_stride, xq + 32 * u, x.K);
      store_sums<0>(sums[0]);
    }
    if (u > 0) group_steps<KIND>(data, pi.c, x, m0, u - 1, sums[(u - 1) % 2], acc);
  }
  if ((units - 1) % 2 == 0) store_sums<0>(sums[0]);
  else store_sums<1>(sums[1]);
  group_steps<KIND>(data, pi.c, x, m0, units - 1, sums[(units - 1) % 2], acc);
  alignas(64) float out[kRows * kPanel];
  for (int m = 0; m < kRows; ++m) _mm512_store_ps(out + m * kPanel, acc[m]);
  store_rows(out, kRows, m0, pi, y, N, bias);
}

template <int KIND>
FT_TARGET_AMX void panel_amx(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M,
                             float* y, int64_t N, const float* bias) {
  static const TileConfig config = loop_config(false);
  const int64_t units = x.K / 32, whole = M / kRows * kRows;
  thread_local std::vector<uint8_t> widened;
  if (kKinds[KIND].codes != kByte && widened.size() < static_cast<size_t>(units * 512 + 64))
    widened.resize(units * 512 + 64);
  uint8_t* buf = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
  const uint8_t* b = codes_tiles<KIND>(data, units, buf);
  load_config(config);
  for (int64_t m0 = 0; m0 < whole; m0 += kRows) rows_amx<KIND>(data, b, pi, x, m0, y, N, bias);
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
  switch (pi.kind) {
    case kNib32: return panel_amx<kNib32>(data, pi, x, M, y, N, bias);
    case kNib32Min: return panel_amx<kNib32Min>(data, pi, x, M, y, N, bias);
    case kByte32: return panel_amx<kByte32>(data, pi, x, M, y, N, bias);
    case kByte32Min: return panel_amx<kByte32Min>(data, pi, x, M, y, N, bias);
    default: return run_panel_vnni(data, pi, x, M, y, N, bias);  // the K-quants
  }
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
  static const TileConfig config = loop_config(true);
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
