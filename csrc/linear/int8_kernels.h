// The int8 mode's kernels (int8_kernels.cpp): x quantized per block of 32 or 256, and rows of x
// against one panel of an int8 matrix, in three loops with the same bits (AVX512-VNNI, AVX2,
// portable). Declarations for int8_linear.cpp, which picks one per call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "linear/int8_layout.h"

namespace freetoken {
namespace int8 {

// x, quantized: what the kernels read. x's block is 32 values, or 256 when the matrix holds a
// K-quant (Matrix::xblock): one d for the superblock lets its groups' integer sums be combined in
// integer (as llama.cpp's Q8_K). d is kept per 32 either way (a 256 block's d repeated 8 times),
// so the kernels of the 32-value formats read it the same.
struct Acts {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K / 32]
  const int16_t* s16;  // [M, K / 16]: sums of q over 16 (|sum| <= 2032)
  const int16_t* s32;  // [M, K / 32]: sums of q over 32 (|sum| <= 4064)
  const float* xs32;   // [M, K / 32]: d * float(sum of q over 32)
  int64_t K;
  // q again, tile by tile of kTileRows rows, the tile's 4 bytes at k side by side:
  // [M / kTileRows][K / 4][kTileRows] (nullptr where the VNNI K-quant loop does not read it).
  const int32_t* qt = nullptr;
  // q again for the AMX K-quant loop, whole tiles of 16 rows, 64 bytes of K at a time (one tile
  // load of 1 KB, not 16 rows K bytes apart): [M / 16][K / 64][16][64] (nullptr where that loop
  // does not read it).
  const int8_t* qa = nullptr;
  // x's sums of 32 and d again for the AMX K-quant loop's steps, a tile of 16 rows and a
  // superblock at a time: [M / 16][K / 256][16] of (8 sums of 32 as int16, then d as a float),
  // 32 bytes a row, so that a step's rows are one address apart by constants (nullptr where
  // that loop does not read it).
  const uint8_t* sd = nullptr;
  // The rows that qa and sd hold: whole tiles of 16, the last one zeros past M (0: no qa).
  int64_t qa_rows = 0;
};

constexpr int kSdRowBytes = 32;  // Acts::sd: a row's 8 sums (16 bytes), its d, padding

constexpr int kTileRows = 12;  // rows a tile of the VNNI K-quant loop (12 vpdpbusd chains)

// Where quantize_block writes one block of B values (B / 32 entries of d and xs32, B / 16 of the
// sums).
struct ActsOut {
  int8_t* q;
  float* d;
  int16_t* s16;
  int16_t* s32;
  float* xs32;
};

// The sums of block i of 32 values, whose codes are q (its d already stored).
FT_INLINE void store_sums(const ActsOut& o, int64_t i, int32_t sa, int32_t sb) {
  o.s16[2 * i] = static_cast<int16_t>(sa);
  o.s16[2 * i + 1] = static_cast<int16_t>(sb);
  o.s32[i] = static_cast<int16_t>(sa + sb);
  o.xs32[i] = o.d[i] * static_cast<float>(sa + sb);
}

// One row's block b of B values (B = 32 or 256), x at x + b * B: q = rint(x * (127 / amax)),
// d = amax / 127 (a non-finite amax gives a NaN d, so the row's outputs are NaN rather than
// garbage).
FT_INLINE void quantize_block(const float* x, int B, const ActsOut& o, int64_t b) {
  x += b * B;
  const int64_t i0 = b * (B / kXBlock);
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < B; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  const float id = finite && amax > 0.f ? 127.f / amax : 0.f;
  for (int s = 0; s < B / kXBlock; ++s) {
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < kXBlock; ++i) {
      const int v = finite ? static_cast<int>(std::nearbyint(x[s * kXBlock + i] * id)) : 0;
      o.q[(i0 + s) * kXBlock + i] = static_cast<int8_t>(v);
      sums[i >> 4] += v;
    }
    o.d[i0 + s] = finite ? amax / 127.f : std::nanf("");
    store_sums(o, i0 + s, sums[0], sums[1]);
  }
}

// Blocks [b0, b1) of B values of x through quantize_block's arithmetic, vectorized (the same bits).
void quantize_blocks_vnni(const float* x, int B, const ActsOut& o, int64_t b0, int64_t b1);
void quantize_blocks_avx2(const float* x, int B, const ActsOut& o, int64_t b0, int64_t b1);

// Rows [m0, m0 + mr) of a tile's sums (acc [mr][16]) into y, + bias: the panel's real outputs.
// A whole panel's row is one fixed-length loop that the compiler turns into vector stores (on
// the many-row steps the stores were a few per cent of the loop's time as scalar code).
FT_INLINE void store_rows(const float* acc, int mr, int64_t m0, const PanelInfo& pi, float* y,
                          int64_t N, const float* bias) {
  const int n = pi.n1 - pi.n0;
  float b[kPanel] = {};  // + 0 where there is no bias, as before
  if (bias)
    for (int o = 0; o < n; ++o) b[o] = bias[pi.n0 + o];
  for (int m = 0; m < mr; ++m) {
    float* __restrict row = y + (m0 + m) * N + pi.n0;
    const float* a = acc + m * kPanel;
    if (n == kPanel) {
      for (int o = 0; o < kPanel; ++o) row[o] = a[o] + b[o];
    } else {
      for (int o = 0; o < n; ++o) row[o] = a[o] + b[o];
    }
  }
}

// y[m, n0..n1) (+ bias) for rows [0, M) of x against the panel at data.
void panel_portable(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias);
void run_panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias);
void run_panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias, bool avx_vnni);

// 12 independent register vpdpbusd chains, `iters` rounds (int8_peak_gops); returns 0.
int32_t vnni_chains(int64_t iters);
// 6 independent register vpmaddubsw + vpaddw pairs (32 products each), `iters` rounds; returns 0.
int32_t avx2_int8_chains(int64_t iters);
// 12 independent register vpdpbusd (VEX, 32 products each) chains, `iters` rounds; returns 0.
int32_t avx_vnni_chains(int64_t iters);

// True when the CPU has AVX-VNNI (VEX vpdpbusd on 256 bits) and AVX2.
bool cpu_has_avx_vnni();

// True when the CPU has AVX512-VNNI (and BW, VL).
bool cpu_has_vnni();

// The AMX loop (int8_amx.cpp): rows [0, M) against panels [p0, p1) (at base + offset), 16 rows a
// tile product (tdpbsud) and the VNNI loop's steps after the integer sums (int8_vnni.h), so the
// same bits. The rows past the last whole 16: a K-quant's as a tile of its own (Acts::qa_rows),
// the 32-value formats' through the VNNI loop. A K-quant panel in ranges of K:
// superblocks [u0, u1) of 256 values, in order, each range's sums left in y for the next
// (u1 * 256 >= K: the last range, which adds the bias); other formats take all of K with the
// range from u0 = 0.
void run_panels_amx(const uint8_t* base, const PanelInfo* panels, int64_t p0, int64_t p1,
                    const Acts& x, int64_t M, int64_t u0, int64_t u1, float* y, int64_t N,
                    const float* bias);
// True when the CPU has AMX-INT8 and Linux lets this process use its tiles (asked once).
bool cpu_has_amx();
// Register tile products (tdpbssd on 16 x 64 tiles), `iters` rounds of 4 (int8_peak_gops).
void amx_chains(int64_t iters);

}  // namespace int8
}  // namespace freetoken
