// The int8 mode's kernels (int8_kernels.cpp): x quantized per block of 32, and rows of x
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

// x, quantized: what the kernels read.

struct Acts {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, K / 32]
  const int32_t* s16; // [M, K / 16]: sums of q over 16
  const float* xs32;  // [M, K / 32]: d * float(sum of q over 32)
  int64_t K;
};

// One row's block of 32: q = rint(x * (127 / amax)), d = amax / 127 (a non-finite amax gives a
// NaN d, so the row's outputs are NaN rather than garbage).
FT_INLINE void quantize_block(const float* x, int8_t* q, float* d, int32_t* s16, float* xs32) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < kXBlock; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  if (!finite) {
    std::memset(q, 0, kXBlock);
    *d = std::nanf("");
    s16[0] = s16[1] = 0;
    *xs32 = *d;
    return;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s[2] = {0, 0};
  for (int i = 0; i < kXBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * id));
    q[i] = static_cast<int8_t>(v);
    s[i >> 4] += v;
  }
  *d = amax / 127.f;
  s16[0] = s[0];
  s16[1] = s[1];
  *xs32 = *d * static_cast<float>(s[0] + s[1]);
}

// Blocks [i0, i1) of x through quantize_block's arithmetic, vectorized (the same bits).
void quantize_blocks_vnni(const float* x, int8_t* q, float* d, int32_t* s16, float* xs,
                          int64_t i0, int64_t i1);
void quantize_blocks_avx2(const float* x, int8_t* q, float* d, int32_t* s16, float* xs,
                          int64_t i0, int64_t i1);

// y[m, n0..n1) (+ bias) for rows [0, M) of x against the panel at data.
void panel_portable(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias);
void run_panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias);
void run_panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias);

// 12 independent register vpdpbusd chains, `iters` rounds (int8_peak_gops); returns 0.
int32_t vnni_chains(int64_t iters);

// True when the CPU has AVX512-VNNI (and BW, VL).
bool cpu_has_vnni();

}  // namespace int8
}  // namespace freetoken
