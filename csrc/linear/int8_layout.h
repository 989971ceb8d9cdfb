// The int8 matrix's layout (int8_linear.cpp says what it is for): the GGUF formats the int8
// mode takes, each block split into codes and the file's own scale numbers, how a panel of 16
// outputs stores them, and GroupRef, which reads a group back one value at a time. Shared by the
// packing and the entry points (int8_linear.cpp) and the kernels (int8_kernels.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/isa.h"
#include "linear/gguf_blocks.h"
#include "linear/int8_linear.h"

namespace freetoken {
namespace int8 {

namespace gb = gguf_blocks;

constexpr int32_t kMagic = 0x38544e49;  // "INT8"
constexpr int32_t kVersion = 3;
constexpr int kPanel = 16;              // outputs per panel (one vector of int32 lanes)
constexpr int64_t kHeaderBytes = 64;
constexpr int kXBlock = 32;             // x's quantization block (256 with a K-quant)

// How a panel stores its codes and scales. Codes: kNib (4-bit, two a byte), kByte, kSix (6-bit:
// a 4-bit plane and a 2-bit plane), kLut (IQ4: 4-bit indices, two a byte, whose code is
// kIq4Codes[index]), kTwo (2-bit, four a byte), kThree (3-bit: a 2-bit plane and a 1-bit one).
// Scales, each the file's own numbers so the repacked copy is about the file's size: kHalf (a
// per group as the file's fp16; kHalfMin: and b), kK4 (Q4_K / Q5_K / Q2_K: fp16 d and dmin a
// superblock, unsigned scale and min a group: a = d * sc, b = -(dmin * m)), kK6 (Q6_K / Q3_K /
// IQ4_XS: fp16 d a superblock, int8 scale a group: a = d * sc). A unit is a block of the file (32
// values) or a superblock (256): the K kinds' unit starts with its scales, then its groups; a
// kHalf group carries its own.
enum Codes : int { kNib, kByte, kSix, kLut, kTwo, kThree };
enum Scales : int { kHalf, kHalfMin, kK4, kK6 };
struct KindInfo {
  int codes, scales, group, unit;
};
enum Kind : int32_t {
  kNib32, kNib32Min, kByte32, kByte32Min, kNibK4, kByteK4, kSixK6,
  kLut32, kLutK6, kTwoK4, kThreeK6
};
constexpr KindInfo kKinds[] = {{kNib, kHalf, 32, 32},   {kNib, kHalfMin, 32, 32},
                               {kByte, kHalf, 32, 32},  {kByte, kHalfMin, 32, 32},
                               {kNib, kK4, 32, 256},    {kByte, kK4, 32, 256},
                               {kSix, kK6, 16, 256},    {kLut, kHalf, 32, 32},
                               {kLut, kK6, 32, 256},    {kTwo, kK4, 16, 256},
                               {kThree, kK6, 16, 256}};

// IQ4_NL's and IQ4_XS's 16 values (gguf_blocks.h's kIq4Values) + 128: unsigned codes, offset 128.
alignas(16) constexpr uint8_t kIq4Codes[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                               129, 141, 153, 166, 181, 197, 217, 241};

// f(std::integral_constant<int, kind>{}): a kernel templated on the kind, picked at run time.
template <typename F>
inline void with_kind(int kind, F&& f) {
  switch (kind) {
    case kNib32: return f(std::integral_constant<int, kNib32>{});
    case kNib32Min: return f(std::integral_constant<int, kNib32Min>{});
    case kByte32: return f(std::integral_constant<int, kByte32>{});
    case kByte32Min: return f(std::integral_constant<int, kByte32Min>{});
    case kNibK4: return f(std::integral_constant<int, kNibK4>{});
    case kByteK4: return f(std::integral_constant<int, kByteK4>{});
    case kLut32: return f(std::integral_constant<int, kLut32>{});
    case kLutK6: return f(std::integral_constant<int, kLutK6>{});
    case kTwoK4: return f(std::integral_constant<int, kTwoK4>{});
    case kThreeK6: return f(std::integral_constant<int, kThreeK6>{});
    default: return f(std::integral_constant<int, kSixK6>{});
  }
}

constexpr bool has_min(int kind) {
  return kKinds[kind].scales == kHalfMin || kKinds[kind].scales == kK4;
}
constexpr int code_bits(int kind) {
  constexpr int bits[] = {4, 8, 6, 4, 2, 3};  // by Codes
  return bits[kKinds[kind].codes];
}
constexpr int64_t code_bytes(int kind) {  // one group, 16 outputs
  return 2 * code_bits(kind) * kKinds[kind].group;
}
constexpr int groups(int kind) { return kKinds[kind].unit / kKinds[kind].group; }
// A K kind's unit head: fp16 d [16] at 0 (kK4: fp16 dmin [16] at 32), then the groups' integer
// scales [groups][16] at sc_offset (kK6: int8), then kK4's mins [groups][16] at min_offset.
constexpr int64_t sc_offset(int kind) { return kKinds[kind].scales == kK4 ? 64 : 32; }
constexpr int64_t min_offset(int kind) { return 64 + 16 * groups(kind); }
constexpr int64_t head_bytes(int kind) {  // the unit's scales (K kinds)
  return kKinds[kind].scales == kK4   ? 64 + 16 * 2 * groups(kind)
         : kKinds[kind].scales == kK6 ? 32 + 16 * groups(kind)
                                      : 0;
}
constexpr int64_t group_bytes(int kind) {  // codes, then a kHalf group's own scales
  return code_bytes(kind) + (kKinds[kind].scales == kHalf ? 32 : kKinds[kind].scales == kHalfMin
                                                                     ? 64 : 0);
}
constexpr int64_t unit_bytes(int kind) {
  return head_bytes(kind) + groups(kind) * group_bytes(kind);
}

// One block of the file, split: codes u, and the scale numbers as the file has them.
struct Parts {
  uint8_t u[256];
  uint16_t d, dmin;  // fp16 bits (kHalf: d = a, dmin = b)
  uint8_t sc[16], mn[16];
};

FT_INLINE uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
FT_INLINE void nibbles(const uint8_t* qs, uint8_t* u) {
  for (int l = 0; l < 16; ++l) {
    u[l] = qs[l] & 15;
    u[16 + l] = qs[l] >> 4;
  }
}
FT_INLINE void five_bit_codes(const uint8_t* qs, uint32_t qh, uint8_t* u) {
  for (int l = 0; l < 16; ++l) {
    u[l] = static_cast<uint8_t>((qs[l] & 15) | (((qh >> l) & 1u) << 4));
    u[16 + l] = static_cast<uint8_t>((qs[l] >> 4) | (((qh >> (16 + l)) & 1u) << 4));
  }
}
FT_INLINE void split_q8_0(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  for (int l = 0; l < 32; ++l) s.u[l] = static_cast<uint8_t>(static_cast<int8_t>(p[2 + l]) + 128);
}
FT_INLINE void split_q4_0(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  nibbles(p + 2, s.u);
}
FT_INLINE void split_q4_1(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  s.dmin = half_bits(p + 2);
  nibbles(p + 4, s.u);
}
FT_INLINE void split_q5_0(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  uint32_t qh;
  std::memcpy(&qh, p + 2, 4);
  five_bit_codes(p + 6, qh, s.u);
}
FT_INLINE void split_q5_1(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  s.dmin = half_bits(p + 2);
  uint32_t qh;
  std::memcpy(&qh, p + 4, 4);
  five_bit_codes(p + 8, qh, s.u);
}
FT_INLINE void k4_scales(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  s.dmin = half_bits(p + 2);
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    gb::scale_min_k4(p + 4, g, &sc, &mn);
    s.sc[g] = static_cast<uint8_t>(sc);
    s.mn[g] = static_cast<uint8_t>(mn);
  }
}
FT_INLINE void split_q4_k(const uint8_t* p, Parts& s) {
  k4_scales(p, s);
  for (int g = 0; g < 8; ++g)
    for (int l = 0; l < 32; ++l)
      s.u[g * 32 + l] = (p[16 + (g >> 1) * 32 + l] >> (4 * (g & 1))) & 15;
}
FT_INLINE void split_q5_k(const uint8_t* p, Parts& s) {
  k4_scales(p, s);
  const uint8_t* qh = p + 16;
  for (int g = 0; g < 8; ++g)
    for (int l = 0; l < 32; ++l)
      s.u[g * 32 + l] = static_cast<uint8_t>(((p[48 + (g >> 1) * 32 + l] >> (4 * (g & 1))) & 15) |
                                             (((qh[l] >> g) & 1) << 4));
}
FT_INLINE void split_q6_k(const uint8_t* p, Parts& s) {
  s.d = half_bits(p + 208);
  for (int g = 0; g < 16; ++g) s.sc[g] = p[192 + g];  // int8
  for (int f = 0; f < 256; ++f) {
    const int h = f >> 7, r = f & 127;
    const int lo = (p[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15;
    const int hi = (p[128 + h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
    s.u[f] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

FT_INLINE void split_iq4_nl(const uint8_t* p, Parts& s) {  // u: the indices (kLut)
  s.d = half_bits(p);
  nibbles(p + 2, s.u);
}
FT_INLINE void split_iq4_xs(const uint8_t* p, Parts& s) {
  s.d = half_bits(p);
  const uint16_t sh = half_bits(p + 2);
  for (int g = 0; g < 8; ++g) {
    const int lo = (p[4 + (g >> 1)] >> (4 * (g & 1))) & 15, hi = (sh >> (2 * g)) & 3;
    s.sc[g] = static_cast<uint8_t>(static_cast<int8_t>((lo | (hi << 4)) - 32));
    nibbles(p + 8 + 16 * g, s.u + 32 * g);
  }
}
FT_INLINE void split_q2_k(const uint8_t* p, Parts& s) {
  s.d = half_bits(p + 80);
  s.dmin = half_bits(p + 82);
  for (int g = 0; g < 16; ++g) {
    s.sc[g] = p[g] & 15;
    s.mn[g] = p[g] >> 4;
  }
  for (int f = 0; f < 256; ++f)  // f = half * 128 + shift * 32 + l
    s.u[f] = (p[16 + (f >> 7) * 32 + (f & 31)] >> (2 * ((f >> 5) & 3))) & 3;
}
FT_INLINE void split_q3_k(const uint8_t* p, Parts& s) {  // u = the 2 low bits + 4 * hmask's bit
  s.d = half_bits(p + 108);
  const uint8_t* sc = p + 96;
  for (int g = 0; g < 16; ++g) {
    const int lo = (sc[g & 7] >> (4 * (g >> 3))) & 15, hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    s.sc[g] = static_cast<uint8_t>(static_cast<int8_t>((lo | (hi << 4)) - 32));
  }
  for (int f = 0; f < 256; ++f) {
    const int l = f & 31;
    const int lo = (p[32 + (f >> 7) * 32 + l] >> (2 * ((f >> 5) & 3))) & 3;
    s.u[f] = static_cast<uint8_t>(lo | (((p[l] >> (f >> 5)) & 1) << 2));
  }
}

using SplitFn = void (*)(const uint8_t* blk, Parts& parts);
struct Format {
  const char* name;
  int values, bytes;  // per block
  Kind kind;
  int32_t c;
  SplitFn split;
};
constexpr Format kFormats[] = {
    {"Q8_0", 32, 34, kByte32, 128, &split_q8_0},  {"Q4_0", 32, 18, kNib32, 8, &split_q4_0},
    {"Q4_1", 32, 20, kNib32Min, 0, &split_q4_1},  {"Q5_0", 32, 22, kByte32, 16, &split_q5_0},
    {"Q5_1", 32, 24, kByte32Min, 0, &split_q5_1}, {"Q4_K", 256, 144, kNibK4, 0, &split_q4_k},
    {"Q5_K", 256, 176, kByteK4, 0, &split_q5_k},  {"Q6_K", 256, 210, kSixK6, 32, &split_q6_k},
    {"Q2_K", 256, 84, kTwoK4, 0, &split_q2_k},    {"Q3_K", 256, 110, kThreeK6, 4, &split_q3_k},
    {"IQ4_NL", 32, 18, kLut32, 128, &split_iq4_nl},
    {"IQ4_XS", 256, 136, kLutK6, 128, &split_iq4_xs},
};
constexpr int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

// --- the packed matrix ---------------------------------------------------------------------------
// Header (int32 words): magic, version, N, K, number of panels P, x's quantization block (256
// when a panel is a K-quant, else 32), 0...; then per panel a
// PanelInfo; then each panel's units (64-byte aligned panels; units follow each other). Codes of
// a byte group: G / 4 vectors, vector s byte 4 o + j = u[o, k0 + 4 s + j]. Of a 4-bit group
// (G = 32): 4 vectors, vector t byte 4 o + j = u[o, k0 + 4 t + j] in the low nibble and
// u[o, k0 + 16 + 4 t + j] in the high one. Of a 6-bit group (G = 16): 2 vectors of the low 4
// bits (vector t: steps t and t + 2, as the 4-bit ones), then 1 vector whose bits 2 s, 2 s + 1
// of byte 4 o + j are u[o, k0 + 4 s + j] >> 4. Scales: fp16 [16] each, u8 / int8 [groups][16].
// Outputs past n1 are zeros.
struct PanelInfo {
  int32_t kind, n0, n1, c;
  int64_t offset;  // bytes from the tensor's start
};

struct Matrix {
  int64_t N, K, P;
  int xblock;
  const PanelInfo* panels;
  const uint8_t* base;
};

inline Matrix read_matrix(const at::Tensor& w, const char* op) {
  TORCH_CHECK_VALUE(is_int8_matrix(w), op, ": not an int8 matrix (int8_matrix)");
  const auto* h = reinterpret_cast<const int32_t*>(w.data_ptr());
  TORCH_CHECK_VALUE(h[1] == kVersion, op, ": int8 matrix version ", h[1], ", expected ", kVersion);
  const auto* base = reinterpret_cast<const uint8_t*>(w.data_ptr());
  return {h[2], h[3], h[4], h[5], reinterpret_cast<const PanelInfo*>(base + kHeaderBytes), base};
}

// Group j of a unit, read one value at a time (the portable loop, unpacking, packing's mirror).
struct GroupRef {
  int kind;
  const uint8_t* unit;
  int j;
  const uint8_t* codes() const { return unit + head_bytes(kind) + j * group_bytes(kind); }
  int code(int o, int k) const {
    const uint8_t* c = codes();
    switch (kKinds[kind].codes) {
      case kNib:
      case kLut: {
        const uint8_t byte = c[64 * ((k & 15) >> 2) + 4 * o + (k & 3)];
        const int v = k < 16 ? byte & 15 : byte >> 4;
        return kKinds[kind].codes == kLut ? kIq4Codes[v] : v;
      }
      case kByte: return c[64 * (k >> 2) + 4 * o + (k & 3)];
      case kTwo:
      case kThree: {
        const int lo = (c[4 * o + (k & 3)] >> (2 * (k >> 2))) & 3;
        if (kKinds[kind].codes == kTwo) return lo;
        return lo | (((c[64 + 2 * o + ((k & 3) >> 1)] >> (4 * (k & 1) + (k >> 2))) & 1) << 2);
      }
      default: {
        const int s = k >> 2;
        const uint8_t byte = c[64 * (s & 1) + 4 * o + (k & 3)];
        const int lo = s < 2 ? byte & 15 : byte >> 4;
        return lo | (((c[128 + 4 * o + (k & 3)] >> (2 * s)) & 3) << 4);
      }
    }
  }
  // A K kind's integer scale and min (kK4) of output o for this group.
  int sc(int o) const {
    const uint8_t v = unit[sc_offset(kind) + 16 * j + o];
    return kKinds[kind].scales == kK4 ? v : static_cast<int8_t>(v);
  }
  int mn(int o) const { return unit[min_offset(kind) + 16 * j + o]; }
  // a and b of output o, exactly as the dequantization computes them (gguf_blocks.h).
  void scales(int o, float* a, float* b) const {
    *b = 0.f;
    switch (kKinds[kind].scales) {
      case kHalf:
      case kHalfMin: {
        const uint8_t* s = codes() + code_bytes(kind);
        *a = gb::half_to_float(s + 2 * o);
        if (kKinds[kind].scales == kHalfMin) *b = gb::half_to_float(s + 32 + 2 * o);
        return;
      }
      case kK4: {
        const float d = gb::half_to_float(unit + 2 * o);
        const float dmin = gb::half_to_float(unit + 32 + 2 * o);
        *a = d * static_cast<float>(sc(o));
        *b = -(dmin * static_cast<float>(mn(o)));
        return;
      }
      default: {
        const float d = gb::half_to_float(unit + 2 * o);
        *a = d * static_cast<float>(sc(o));
        return;
      }
    }
  }
};

inline int format_id(const std::string& name) {
  for (int f = 0; f < kNumFormats; ++f)
    if (name == kFormats[f].name) return f;
  return -1;
}

// One panel's units from the rows n0..n1 of format f (the layout of GroupRef). Compiled per kind
// (with_kind): a switch on the code width for every weight was most of a model's load time.
template <int KIND>
inline void fill_panel_kind(const Format& f, const uint8_t* const* rows, int n0, int n1,
                            int64_t K, uint8_t* out) {
  constexpr int kind = KIND;
  constexpr KindInfo ki = kKinds[kind];
  constexpr int G = ki.group;
  const int64_t units = K / ki.unit;
  for (int o = 0; o < n1 - n0; ++o) {
    for (int64_t u = 0; u < units; ++u) {
      Parts s{};
      f.split(rows[n0 + o] + u * f.bytes, s);
      uint8_t* unit = out + u * unit_bytes(kind);
      if (ki.scales == kK4 || ki.scales == kK6) std::memcpy(unit + 2 * o, &s.d, 2);
      if (ki.scales == kK4) std::memcpy(unit + 32 + 2 * o, &s.dmin, 2);
      for (int j = 0; j < ki.unit / G; ++j) {
        uint8_t* codes = unit + head_bytes(kind) + j * group_bytes(kind);
        if (ki.scales == kK4) {
          unit[sc_offset(kind) + 16 * j + o] = s.sc[j];
          unit[min_offset(kind) + 16 * j + o] = s.mn[j];
        } else if (ki.scales == kK6) {
          unit[sc_offset(kind) + 16 * j + o] = s.sc[j];
        } else {
          std::memcpy(codes + code_bytes(kind) + 2 * o, &s.d, 2);
          if (ki.scales == kHalfMin) std::memcpy(codes + code_bytes(kind) + 32 + 2 * o, &s.dmin, 2);
        }
        const uint8_t* v = s.u + j * G;
        if constexpr (ki.codes == kNib || ki.codes == kLut) {
          for (int k = 0; k < 16; ++k)
            codes[64 * (k >> 2) + 4 * o + (k & 3)] =
                static_cast<uint8_t>(v[k] | (v[16 + k] << 4));
        } else if constexpr (ki.codes == kByte) {
          for (int k = 0; k < G; ++k) codes[64 * (k >> 2) + 4 * o + (k & 3)] = v[k];
        } else if constexpr (ki.codes == kTwo || ki.codes == kThree) {
          // byte 4 o + j: bits 2 s, 2 s + 1 the low 2 bits of code 4 s + j; kThree's third bits
          // in bytes 2 o, 2 o + 1 from 64: bit 4 (j & 1) + s of byte 2 o + (j >> 1)
          for (int k = 0; k < 4; ++k) {
            codes[4 * o + k] = static_cast<uint8_t>((v[k] & 3) | ((v[4 + k] & 3) << 2) |
                                                    ((v[8 + k] & 3) << 4) | ((v[12 + k] & 3) << 6));
            if constexpr (ki.codes == kThree)
              for (int t = 0; t < 4; ++t)
                codes[64 + 2 * o + (k >> 1)] |=
                    static_cast<uint8_t>(((v[4 * t + k] >> 2) & 1) << (4 * (k & 1) + t));
          }
        } else {
          for (int k = 0; k < 8; ++k)  // steps t and t + 2 share a byte of the 4-bit plane
            codes[64 * (k >> 2) + 4 * o + (k & 3)] =
                static_cast<uint8_t>((v[k] & 15) | ((v[8 + k] & 15) << 4));
          for (int k = 0; k < 4; ++k)
            codes[128 + 4 * o + k] = static_cast<uint8_t>((v[k] >> 4) | ((v[4 + k] >> 4) << 2) |
                                                          ((v[8 + k] >> 4) << 4) |
                                                          ((v[12 + k] >> 4) << 6));
        }
      }
    }
  }
}

inline void fill_panel(const Format& f, const uint8_t* const* rows, int n0, int n1, int64_t K,
                       uint8_t* out) {
  with_kind(f.kind, [&](auto kind) {
    fill_panel_kind<decltype(kind)::value>(f, rows, n0, n1, K, out);
  });
}

}  // namespace int8
}  // namespace freetoken
