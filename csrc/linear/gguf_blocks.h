// The GGUF block formats, one scalar function per format: a block's bytes -> its values in fp32,
// each exactly the value the gguf package's `dequantize` gives (why that is exact:
// gguf_dequant.cpp). Shared by the row dequantization (gguf_dequant.cpp) and by the block-resident
// linear (gguf_linear.cpp), which decodes the common formats in registers and the rest through
// these.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/isa.h"

namespace freetoken {
namespace gguf_blocks {

FT_INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact
    const float f = static_cast<float>(man) * 0x1p-24f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// --- 32-value blocks ---------------------------------------------------------------------------

FT_INLINE void q4_0(const uint8_t* b, float* y) {  // d, qs[16]
  const float d = half_to_float(b);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>((b[2 + l] & 15) - 8);
    y[16 + l] = d * static_cast<float>((b[2 + l] >> 4) - 8);
  }
}

FT_INLINE void q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]
  const float d = half_to_float(b), m = half_to_float(b + 2);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>(b[4 + l] & 15) + m;
    y[16 + l] = d * static_cast<float>(b[4 + l] >> 4) + m;
  }
}

FT_INLINE void q5_0(const uint8_t* b, float* y) {  // d, qh (u32), qs[16]
  const float d = half_to_float(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  for (int l = 0; l < 16; ++l) {
    const int lo = (b[6 + l] & 15) | static_cast<int>(((qh >> l) & 1u) << 4);
    const int hi = (b[6 + l] >> 4) | static_cast<int>(((qh >> (16 + l)) & 1u) << 4);
    y[l] = d * static_cast<float>(lo - 16);
    y[16 + l] = d * static_cast<float>(hi - 16);
  }
}

FT_INLINE void q5_1(const uint8_t* b, float* y) {  // d, m, qh (u32), qs[16]
  const float d = half_to_float(b), m = half_to_float(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  for (int l = 0; l < 16; ++l) {
    const int lo = (b[8 + l] & 15) | static_cast<int>(((qh >> l) & 1u) << 4);
    const int hi = (b[8 + l] >> 4) | static_cast<int>(((qh >> (16 + l)) & 1u) << 4);
    y[l] = d * static_cast<float>(lo) + m;
    y[16 + l] = d * static_cast<float>(hi) + m;
  }
}

FT_INLINE void q8_0(const uint8_t* b, float* y) {  // d, qs[32] int8
  const float d = half_to_float(b);
  for (int l = 0; l < 32; ++l) y[l] = static_cast<float>(static_cast<int8_t>(b[2 + l])) * d;
}

FT_INLINE void iq4_nl(const uint8_t* b, float* y) {  // d, qs[16] (indices into kIq4Values)
  const float d = half_to_float(b);
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<float>(kIq4Values[b[2 + l] & 15]);
    y[16 + l] = d * static_cast<float>(kIq4Values[b[2 + l] >> 4]);
  }
}

// --- 256-value blocks (K-quants) --------------------------------------------------------------

// The 6-bit scale and min of sub-block g (0..7) packed in 12 bytes (Q4_K and Q5_K).
FT_INLINE void scale_min_k4(const uint8_t* s, int g, int* sc, int* mn) {
  if (g < 4) {
    *sc = s[g] & 63;
    *mn = s[4 + g] & 63;
  } else {
    *sc = (s[8 + g - 4] & 15) | ((s[g - 4] >> 2) & 0x30);
    *mn = (s[8 + g - 4] >> 4) | ((s[g] >> 2) & 0x30);
  }
}

FT_INLINE void q2_k(const uint8_t* b, float* y) {  // scales[16], qs[64], d, dmin
  const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
  for (int f = 0; f < 256; ++f) {  // f = half * 128 + shift * 32 + l
    const int h = f >> 7, s = (f >> 5) & 3, l = f & 31, g = f >> 4;
    const float dl = d * static_cast<float>(b[g] & 15);
    const float ml = dmin * static_cast<float>(b[g] >> 4);
    const int q = (b[16 + h * 32 + l] >> (2 * s)) & 3;
    y[f] = dl * static_cast<float>(q) - ml;
  }
}

FT_INLINE void q3_k(const uint8_t* b, float* y) {  // hmask[32], qs[64], scales[12], d
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half_to_float(b + 108);
  float dl[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = (sc[i & 7] >> (4 * (i >> 3))) & 15;
    const int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    dl[i] = d * static_cast<float>((lo | (hi << 4)) - 32);
  }
  for (int f = 0; f < 256; ++f) {
    const int h = f >> 7, s = (f >> 5) & 3, l = f & 31;
    const int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
    const int qh = ((hmask[l] >> (f >> 5)) & 1) ^ 1;  // the offset is 4 where the bit is 0
    y[f] = dl[f >> 4] * static_cast<float>(ql - (qh << 2));
  }
}

FT_INLINE void q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  for (int g = 0; g < 8; ++g) {  // sub-block g = 32-byte chunk g / 2, nibble g % 2
    int sc, mn;
    scale_min_k4(b + 4, g, &sc, &mn);
    const float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(mn);
    const uint8_t* q = b + 16 + (g >> 1) * 32;
    const int shift = 4 * (g & 1);
    for (int l = 0; l < 32; ++l)
      y[g * 32 + l] = dg * static_cast<float>((q[l] >> shift) & 15) - mg;
  }
}

FT_INLINE void q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* qh = b + 16;
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    scale_min_k4(b + 4, g, &sc, &mn);
    const float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(mn);
    const uint8_t* q = b + 48 + (g >> 1) * 32;
    const int shift = 4 * (g & 1);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 15) | (((qh[l] >> g) & 1) << 4);
      y[g * 32 + l] = dg * static_cast<float>(v) - mg;
    }
  }
}

FT_INLINE void q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] int8, d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const float d = half_to_float(b + 208);
  for (int f = 0; f < 256; ++f) {
    const int h = f >> 7, r = f & 127;
    const int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15;
    const int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
    const float dg = d * static_cast<float>(static_cast<int8_t>(b[192 + (f >> 4)]));
    y[f] = dg * static_cast<float>((lo | (hi << 4)) - 32);
  }
}

FT_INLINE void iq4_xs(const uint8_t* b, float* y) {  // d, scales_h (u16), scales_l[4], qs[128]
  const float d = half_to_float(b);
  uint16_t sh;
  std::memcpy(&sh, b + 2, 2);
  for (int g = 0; g < 8; ++g) {
    const int lo = (b[4 + (g >> 1)] >> (4 * (g & 1))) & 15;
    const int hi = (sh >> (2 * g)) & 3;
    const float dg = d * static_cast<float>((lo | (hi << 4)) - 32);
    const uint8_t* q = b + 8 + g * 16;
    for (int l = 0; l < 16; ++l) {
      y[g * 32 + l] = dg * static_cast<float>(kIq4Values[q[l] & 15]);
      y[g * 32 + 16 + l] = dg * static_cast<float>(kIq4Values[q[l] >> 4]);
    }
  }
}

// --- plain float rows --------------------------------------------------------------------------

FT_INLINE void f16(const uint8_t* b, float* y) { y[0] = half_to_float(b); }

FT_INLINE void bf16(const uint8_t* b, float* y) {
  uint16_t h;
  std::memcpy(&h, b, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  std::memcpy(y, &bits, 4);
}

FT_INLINE void f32(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }

}  // namespace gguf_blocks
}  // namespace freetoken
