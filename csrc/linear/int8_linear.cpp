// The int8 compute mode's linear (issue 24): y = x @ W^T (+ bias), where x is quantized to int8 per
// block of 32 values with an fp32 scale (as llama.cpp's Q8_0) and W keeps its GGUF integer codes,
// so each group of 32 (16 for Q6_K) weights times x is one exact integer dot product, scaled in
// fp32. Not exact: x loses its low bits (the exact mode is gguf_linear.cpp). Three loops with
// the same bits: AVX512-VNNI, AVX2 (CPUs without VNNI), portable (baseline x86-64).
//
// The weight: every GGUF format whose weight is w = a * (u - c) + b with an unsigned integer code
// u, per-group fp32 a and b (b = 0 where the format has no min) and a per-format integer offset c
// (Q8_0 128, Q4_0 8, Q5_0 16, Q6_K 32, else 0) is repacked at load, 16 outputs at a time, so that
// one 64-byte vector holds 4 consecutive codes of each of the 16 outputs: VNNI's vpdpbusd then
// adds 4 products per output lane, and the 16 lanes are 16 outputs (no horizontal sums). The
// codes keep their width (4-bit two a byte; 6-bit as a 4-bit and a 2-bit plane; 5-bit in a
// byte) and the scales stay the file's own numbers (fp16 d, 6-bit or int8 group scales), so
// the copy is about the file's size (Q4_K 4.6 bits a weight, Q6_K 6.6, Q8_0 8.5, Q5_x 8.5-9);
// a and b are computed from them as the dequantization does (gguf_blocks.h), so a * (u - c) + b
// is each dequantized weight bit for bit (tested). The repacked copy is the one copy in use
// (the file's pages are only read while packing).
//
// The arithmetic, for row m, output n, in increasing group order g (integer sums exact, then
// fp32 without FMA contraction, so a NumPy reference reproduces it bit for bit, and no input but
// the row itself changes it: the same bits for any row count, rows beside it, thread count or ISA):
//   P   = sum_{k in g} u[n, k] * q[m, k] - c * S            (int32; S = sum_{k in g} q[m, k])
//   acc = acc + float(P) * (a[n, g] * d[m, k / 32])
//   acc = acc + b[n, g] * (d[m, k / 32] * float(S))         (formats with a min only)
// where q[m, k] = rint(x[m, k] * (127 / amax)) and d = amax / 127 over x's block of 32.
#include "linear/int8_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/isa.h"
#include "common/task_pool.h"
#include "linear/gguf_blocks.h"
#include "linear/panel_common.h"

namespace freetoken {

namespace {

namespace gb = gguf_blocks;

constexpr int32_t kMagic = 0x38544e49;  // "INT8"
constexpr int32_t kVersion = 2;
constexpr int kPanel = 16;              // outputs per panel (one vector of int32 lanes)
constexpr int64_t kHeaderBytes = 64;
constexpr int kXBlock = 32;             // x's quantization block

// How a panel stores its codes and scales. Codes: kNib (4-bit, two a byte), kByte, kSix (6-bit:
// a 4-bit plane and a 2-bit plane). Scales, each the file's own numbers so the repacked copy is
// about the file's size: kHalf (a per group as the file's fp16; kHalfMin: and b), kK4 (Q4_K /
// Q5_K: fp16 d and dmin a superblock, 6-bit scale and min a group: a = d * sc,
// b = -(dmin * m)), kK6 (Q6_K: fp16 d a superblock, int8 scale a group: a = d * sc). A unit is
// a block of the file (32 values) or a superblock (256): the K kinds' unit starts with its
// scales, then its groups; a kHalf group carries its own.
enum Codes : int { kNib, kByte, kSix };
enum Scales : int { kHalf, kHalfMin, kK4, kK6 };
struct KindInfo {
  int codes, scales, group, unit;
};
enum Kind : int32_t { kNib32, kNib32Min, kByte32, kByte32Min, kNibK4, kByteK4, kSixK6 };
constexpr KindInfo kKinds[] = {{kNib, kHalf, 32, 32},   {kNib, kHalfMin, 32, 32},
                               {kByte, kHalf, 32, 32},  {kByte, kHalfMin, 32, 32},
                               {kNib, kK4, 32, 256},    {kByte, kK4, 32, 256},
                               {kSix, kK6, 16, 256}};

constexpr bool has_min(int kind) {
  return kKinds[kind].scales == kHalfMin || kKinds[kind].scales == kK4;
}
constexpr int64_t code_bytes(int kind) {  // one group, 16 outputs
  return (kKinds[kind].codes == kNib ? 8 : kKinds[kind].codes == kByte ? 16 : 12) *
         kKinds[kind].group;
}
constexpr int64_t head_bytes(int kind) {  // the unit's scales (K kinds)
  return kKinds[kind].scales == kK4 ? 64 + 16 * 2 * 8 : kKinds[kind].scales == kK6 ? 32 + 16 * 16
                                                                                    : 0;
}
constexpr int64_t group_bytes(int kind) {  // codes, then a kHalf group's own scales
  return code_bytes(kind) + (kKinds[kind].scales == kHalf ? 32 : kKinds[kind].scales == kHalfMin
                                                                     ? 64 : 0);
}
constexpr int64_t unit_bytes(int kind) {
  return head_bytes(kind) + kKinds[kind].unit / kKinds[kind].group * group_bytes(kind);
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
};
constexpr int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

// --- the packed matrix ---------------------------------------------------------------------------
// Header (int32 words): magic, version, N, K, number of panels P, 0...; then per panel a
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
  const PanelInfo* panels;
  const uint8_t* base;
};

Matrix read_matrix(const at::Tensor& w, const char* op) {
  TORCH_CHECK_VALUE(is_int8_matrix(w), op, ": not an int8 matrix (int8_matrix)");
  const auto* h = reinterpret_cast<const int32_t*>(w.data_ptr());
  TORCH_CHECK_VALUE(h[1] == kVersion, op, ": int8 matrix version ", h[1], ", expected ", kVersion);
  const auto* base = reinterpret_cast<const uint8_t*>(w.data_ptr());
  return {h[2], h[3], h[4], reinterpret_cast<const PanelInfo*>(base + kHeaderBytes), base};
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
      case kNib: {
        const uint8_t byte = c[64 * ((k & 15) >> 2) + 4 * o + (k & 3)];
        return k < 16 ? byte & 15 : byte >> 4;
      }
      case kByte: return c[64 * (k >> 2) + 4 * o + (k & 3)];
      default: {
        const int s = k >> 2;
        const uint8_t byte = c[64 * (s & 1) + 4 * o + (k & 3)];
        const int lo = s < 2 ? byte & 15 : byte >> 4;
        return lo | (((c[128 + 4 * o + (k & 3)] >> (2 * s)) & 3) << 4);
      }
    }
  }
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
        *a = d * static_cast<float>(unit[64 + 16 * j + o]);
        *b = -(dmin * static_cast<float>(unit[64 + 128 + 16 * j + o]));
        return;
      }
      default: {
        const float d = gb::half_to_float(unit + 2 * o);
        *a = d * static_cast<float>(static_cast<int8_t>(unit[32 + 16 * j + o]));
        return;
      }
    }
  }
};

// --- x, quantized --------------------------------------------------------------------------------

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

#if FT_HAS_ISA_VARIANTS
void quantize_blocks_vnni(const float* x, int8_t* q, float* d, int32_t* s16, float* xs,
                          int64_t i0, int64_t i1);
void quantize_blocks_avx2(const float* x, int8_t* q, float* d, int32_t* s16, float* xs,
                          int64_t i0, int64_t i1);
#endif
bool use_vnni();
bool use_avx2();

struct ActStore {
  at::Tensor q, d, s16, xs32;
  Acts view() const {
    return {q.data_ptr<int8_t>(), d.data_ptr<float>(), s16.data_ptr<int32_t>(),
            xs32.data_ptr<float>(), q.size(1)};
  }
};

ActStore quantize(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), B = K / kXBlock;
  ActStore s{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, B}, x.options()),
             at::empty({M, 2 * B}, x.options().dtype(at::kInt)), at::empty({M, B}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* q = s.q.data_ptr<int8_t>();
  float* d = s.d.data_ptr<float>();
  int32_t* s16 = s.s16.data_ptr<int32_t>();
  float* xs = s.xs32.data_ptr<float>();
  // Worth the pool from a few thousand blocks (a prefill step).
  const int64_t nblocks = M * B;
  const int nthreads = nblocks < 4096 ? 1 : at::get_num_threads();
  const int64_t n = nthreads == 1 ? 1 : 4 * nthreads;
  const bool vnni = use_vnni(), avx2 = use_avx2();
  TaskPool::get().run(n, nthreads, [&](int64_t t) {
    const int64_t i0 = nblocks * t / n, i1 = nblocks * (t + 1) / n;
#if FT_HAS_ISA_VARIANTS
    if (vnni) return quantize_blocks_vnni(xp, q, d, s16, xs, i0, i1);
    if (avx2) return quantize_blocks_avx2(xp, q, d, s16, xs, i0, i1);
#endif
    for (int64_t i = i0; i < i1; ++i)
      quantize_block(xp + i * kXBlock, q + i * kXBlock, d + i, s16 + 2 * i, xs + i);
  });
  return s;
}

// fp32 products kept apart from the adds that follow (the file builds with -ffp-contract=fast):
// the arithmetic above, not an FMA of it.
FT_INLINE float no_contract(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#else
  volatile float kept = v;
  v = kept;
#endif
  return v;
}

// --- the portable kernel (the reference order; also the baseline and AVX2 variants) ------------

void panel_portable(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias) {
  const KindInfo& ki = kKinds[pi.kind];
  const int G = ki.group, per_unit = ki.unit / G;
  const int64_t units = x.K / ki.unit, ld16 = x.K / 16, ld32 = x.K / kXBlock;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    const int8_t* xq = x.q + m * x.K;
    for (int64_t u = 0; u < units; ++u) {
      for (int j = 0; j < per_unit; ++j) {
        const GroupRef gr{pi.kind, data + u * unit_bytes(pi.kind), j};
        const int64_t k0 = u * ki.unit + j * G;
        int32_t S = 0;
        for (int i = 0; i < G / 16; ++i) S += x.s16[m * ld16 + k0 / 16 + i];
        const float d = x.d[m * ld32 + k0 / kXBlock];
        for (int o = 0; o < kPanel; ++o) {
          int32_t P = -pi.c * S;
          for (int k = 0; k < G; ++k) P += gr.code(o, k) * xq[k0 + k];
          float a, b;
          gr.scales(o, &a, &b);
          const float t = no_contract(a * d);
          acc[o] = acc[o] + no_contract(static_cast<float>(P) * t);
          if (has_min(pi.kind))
            acc[o] = acc[o] + no_contract(b * x.xs32[m * ld32 + k0 / kXBlock]);
        }
      }
    }
    for (int o = 0; o < pi.n1 - pi.n0; ++o)
      y[m * N + pi.n0 + o] = acc[o] + (bias ? bias[pi.n0 + o] : 0.f);
  }
}

// --- the VNNI kernel -----------------------------------------------------------------------------
#if FT_HAS_ISA_VARIANTS
#define FT_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

FT_TARGET_VNNI FT_INLINE __m512 no_contract512(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// acc += codes . (the 4 int8 at p, broadcast to every lane): one vpdpbusd with its broadcast
// folded into the load (GCC emits a separate vpbroadcastd for the intrinsic form).
FT_TARGET_VNNI FT_INLINE __m512i dot4(__m512i acc, __m512i codes, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

FT_TARGET_VNNI FT_INLINE __m512 halfs16(const uint8_t* p) {
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
FT_TARGET_VNNI FT_INLINE __m512 bytes16(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_maskz_cvtepi32_ps(0xFFFF, is_signed ? _mm512_maskz_cvtepi8_epi32(0xFFFF, v)
                                                    : _mm512_maskz_cvtepu8_epi32(0xFFFF, v));
}

FT_TARGET_VNNI FT_INLINE float hmax(__m512 v) {
  const __m256 a = _mm256_max_ps(_mm512_maskz_extractf32x8_ps(0xFF, v, 0),
                                 _mm512_maskz_extractf32x8_ps(0xFF, v, 1));
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}
FT_TARGET_VNNI FT_INLINE int32_t hsum(__m512i v) {
  const __m256i a = _mm256_add_epi32(_mm512_maskz_extracti32x8_epi32(0xFF, v, 0),
                                     _mm512_maskz_extracti32x8_epi32(0xFF, v, 1));
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_add_epi32(b, _mm_unpackhi_epi64(b, b));
  return _mm_cvtsi128_si32(_mm_add_epi32(b, _mm_shuffle_epi32(b, 1)));
}

// quantize_block's arithmetic, 16 lanes at a time (cvtps2dq rounds to nearest even, as
// nearbyint does); a block with a NaN or an infinity takes quantize_block itself.
FT_TARGET_VNNI void quantize_blocks_vnni(const float* x, int8_t* q, float* d, int32_t* s16,
                                         float* xs, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + i * kXBlock;
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    if (_mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99)) {
      quantize_block(xb, q + i * kXBlock, d + i, s16 + 2 * i, xs + i);
      continue;
    }
    const float amax = hmax(_mm512_maskz_max_ps(0xFFFF, _mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qa = _mm512_maskz_cvtps_epi32(0xFFFF, _mm512_mul_ps(a, id));
    const __m512i qb = _mm512_maskz_cvtps_epi32(0xFFFF, _mm512_mul_ps(b, id));
    auto* qi = reinterpret_cast<__m128i*>(q + i * kXBlock);
    _mm_storeu_si128(qi, _mm512_maskz_cvtepi32_epi8(0xFFFF, qa));
    _mm_storeu_si128(qi + 1, _mm512_maskz_cvtepi32_epi8(0xFFFF, qb));
    const int32_t sa = hsum(qa), sb = hsum(qb);
    d[i] = amax / 127.f;
    s16[2 * i] = sa;
    s16[2 * i + 1] = sb;
    xs[i] = d[i] * static_cast<float>(sa + sb);
  }
}

// NOTE: a panel streams from DRAM once a step: the bytes kPrefetchBytes ahead of the group being
// read are asked for (1B Q4_K ffn_gate at 8 rows, one thread: 5.8-6.2 -> 4.1-4.4 ms).
constexpr int64_t kPrefetchBytes = 2048;

// Rows [m0, m0 + MR) against one panel over all of K.
template <int MR, int KIND>
FT_TARGET_VNNI FT_INLINE void panel_rows_vnni(const uint8_t* data, int32_t c, int64_t units,
                                              const Acts& x, int64_t m0, float* acc_out) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int G = ki.group, PER = ki.unit / G;
  const int64_t ld16 = x.K / 16, ld32 = x.K / kXBlock;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
  const __m512 sign = _mm512_set1_ps(-0.f);
  const uint8_t* prefetched = data + kPrefetchBytes;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = data + u * unit_bytes(KIND);
    __m512 dv = _mm512_setzero_ps(), dminv = _mm512_setzero_ps();
    if constexpr (ki.scales == kK4 || ki.scales == kK6) dv = halfs16(unit);
    if constexpr (ki.scales == kK4) dminv = halfs16(unit + 32);
#pragma GCC unroll 1
    for (int j = 0; j < PER; ++j) {
      const uint8_t* codes = unit + head_bytes(KIND) + j * group_bytes(KIND);
      for (; prefetched < codes + group_bytes(KIND) + kPrefetchBytes; prefetched += 64)
        __builtin_prefetch(prefetched, 0, 3);
      const int64_t k0 = u * ki.unit + j * G;
      __m512 a, b = _mm512_setzero_ps();
      if constexpr (ki.scales == kHalf || ki.scales == kHalfMin) {
        a = halfs16(codes + code_bytes(KIND));
        if constexpr (ki.scales == kHalfMin) b = halfs16(codes + code_bytes(KIND) + 32);
      } else if constexpr (ki.scales == kK4) {
        a = _mm512_mul_ps(dv, bytes16(unit + 64 + 16 * j, false));
        b = _mm512_xor_ps(_mm512_mul_ps(dminv, bytes16(unit + 64 + 128 + 16 * j, false)), sign);
      } else {
        a = _mm512_mul_ps(dv, bytes16(unit + 32 + 16 * j, true));
      }
      __m512i P[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        if constexpr (has_min(KIND)) {
          P[m] = _mm512_setzero_si512();
        } else {
          const int32_t* s = x.s16 + (m0 + m) * ld16 + k0 / 16;
          const int32_t S = G == 32 ? s[0] + s[1] : s[0];
          P[m] = _mm512_set1_epi32(-c * S);
        }
      }
      if constexpr (ki.codes == kNib) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m512i v = _mm512_loadu_si512(codes + 64 * t);
          const __m512i lo = _mm512_and_si512(v, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const int8_t* xq = x.q + (m0 + m) * x.K + k0;
            P[m] = dot4(P[m], lo, xq + 4 * t);
            P[m] = dot4(P[m], hi, xq + 16 + 4 * t);
          }
        }
      } else if constexpr (ki.codes == kByte) {
#pragma GCC unroll 8
        for (int s = 0; s < G / 4; ++s) {
          const __m512i v = _mm512_loadu_si512(codes + 64 * s);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) P[m] = dot4(P[m], v, x.q + (m0 + m) * x.K + k0 + 4 * s);
        }
      } else {  // 6-bit: the 4-bit plane (steps t, t + 2) and the 2-bit plane (bits 2 s, 2 s + 1)
        const __m512i plane = _mm512_loadu_si512(codes + 128);
        __m512i v[4];
        for (int t = 0; t < 2; ++t) {
          const __m512i n = _mm512_loadu_si512(codes + 64 * t);
          v[t] = _mm512_and_si512(n, low4);
          v[t + 2] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low4);
        }
        v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(plane, 4), hi2));
        v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(plane, 2), hi2));
        v[2] = _mm512_or_si512(v[2], _mm512_and_si512(plane, hi2));
        v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_srli_epi16(plane, 2), hi2));
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) P[m] = dot4(P[m], v[s], x.q + (m0 + m) * x.K + k0 + 4 * s);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int64_t xb = (m0 + m) * ld32 + k0 / kXBlock;
        const __m512 t = no_contract512(_mm512_mul_ps(a, _mm512_set1_ps(x.d[xb])));
        acc[m] = _mm512_add_ps(
            acc[m], no_contract512(_mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, P[m]), t)));
        if constexpr (has_min(KIND))
          acc[m] = _mm512_add_ps(acc[m],
                                 no_contract512(_mm512_mul_ps(b, _mm512_set1_ps(x.xs32[xb]))));
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc_out + m * kPanel, acc[m]);
}

constexpr int kVnniRows = 8;  // rows a register tile: 8 int32 sums + 8 fp32 accumulators

template <int KIND, int MR>
FT_TARGET_VNNI FT_INLINE void rows_dispatch(int mr, const uint8_t* data, int32_t c, int64_t units,
                                            const Acts& x, int64_t m0, float* acc) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_dispatch<KIND, MR - 1>(mr, data, c, units, x, m0, acc);
  }
  panel_rows_vnni<MR, KIND>(data, c, units, x, m0, acc);
}

template <int KIND>
FT_TARGET_VNNI void panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                               int64_t M, float* y, int64_t N, const float* bias) {
  alignas(64) float acc[kVnniRows * kPanel];
  const int nv = pi.n1 - pi.n0;
  const int64_t units = x.K / kKinds[KIND].unit;
  for (int64_t m0 = 0; m0 < M; m0 += kVnniRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kVnniRows, M - m0));
    rows_dispatch<KIND, kVnniRows>(mr, data, pi.c, units, x, m0, acc);
    for (int m = 0; m < mr; ++m)
      for (int o = 0; o < nv; ++o)
        y[(m0 + m) * N + pi.n0 + o] = acc[m * kPanel + o] + (bias ? bias[pi.n0 + o] : 0.f);
  }
}

FT_TARGET_VNNI void run_panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                                   int64_t M, float* y, int64_t N, const float* bias) {
  switch (pi.kind) {
    case kNib32: return panel_vnni<kNib32>(data, pi, x, M, y, N, bias);
    case kNib32Min: return panel_vnni<kNib32Min>(data, pi, x, M, y, N, bias);
    case kByte32: return panel_vnni<kByte32>(data, pi, x, M, y, N, bias);
    case kByte32Min: return panel_vnni<kByte32Min>(data, pi, x, M, y, N, bias);
    case kNibK4: return panel_vnni<kNibK4>(data, pi, x, M, y, N, bias);
    case kByteK4: return panel_vnni<kByteK4>(data, pi, x, M, y, N, bias);
    default: return panel_vnni<kSixK6>(data, pi, x, M, y, N, bias);
  }
}

// --- the AVX2 kernel (CPUs without AVX512-VNNI) ---------------------------------------------------
// The same layout and arithmetic with 8-lane vectors: a panel is two halves of 8 outputs, and
// each 4-code step is vpmaddubsw (u8 x s8 -> pairs of int16) then vpmaddwd by ones (-> int32).
// No pair can saturate: codes <= 63 give |pair| <= 16002, and Q8_0's biased codes are unbiased
// first, its products taken as |q| x sign(q) * x (|pair| <= 32512), which sums to P directly.
FT_TARGET_AVX2 FT_INLINE __m256 no_contract256(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

FT_TARGET_AVX2 FT_INLINE __m256i bcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

FT_TARGET_AVX2 FT_INLINE __m256i load_half(const uint8_t* p, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
}

// One step: 4 codes of each output (halves lo8, hi8) times the 4 x at xk + m * ldx, row m.
template <int MR>
FT_TARGET_AVX2 FT_INLINE void step_avx2(__m256i (&P)[MR][2], __m256i lo8, __m256i hi8,
                                        bool signed_codes, const int8_t* xk, int64_t ldx) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i cv[2] = {lo8, hi8}, sg[2] = {lo8, hi8};
  if (signed_codes) {
    for (int h = 0; h < 2; ++h) {
      sg[h] = _mm256_xor_si256(cv[h], _mm256_set1_epi8(static_cast<char>(0x80)));  // u - 128
      cv[h] = _mm256_abs_epi8(sg[h]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256i xv = bcast4_256(xk + m * ldx);
    for (int h = 0; h < 2; ++h) {
      const __m256i xs = signed_codes ? _mm256_sign_epi8(xv, sg[h]) : xv;
      P[m][h] = _mm256_add_epi32(P[m][h],
                                 _mm256_madd_epi16(_mm256_maddubs_epi16(cv[h], xs), ones));
    }
  }
}

// Rows [m0, m0 + MR) against one panel; acc_out [MR][16].
template <int MR, int KIND>
FT_TARGET_AVX2 FT_INLINE void panel_rows_avx2(const uint8_t* data, int32_t c, int64_t units,
                                              const Acts& x, int64_t m0, float* acc_out) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int G = ki.group, PER = ki.unit / G;
  const bool signed_codes = c == 128;  // Q8_0: products of the unbiased codes
  const int64_t ld16 = x.K / 16, ld32 = x.K / kXBlock;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15), hi2 = _mm256_set1_epi8(0x30);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = data + u * unit_bytes(KIND);
    for (int j = 0; j < PER; ++j) {
      const uint8_t* codes = unit + head_bytes(KIND) + j * group_bytes(KIND);
      const int64_t k0 = u * ki.unit + j * G;
      __m256i P[MR][2];
      for (int m = 0; m < MR; ++m) {
        int32_t init = 0;
        if (!has_min(KIND) && !signed_codes) {
          const int32_t* s = x.s16 + (m0 + m) * ld16 + k0 / 16;
          init = -c * (G == 32 ? s[0] + s[1] : s[0]);
        }
        P[m][0] = P[m][1] = _mm256_set1_epi32(init);
      }
      const int8_t* xk = x.q + m0 * x.K + k0;
      if constexpr (ki.codes == kNib) {
        for (int t = 0; t < 4; ++t) {
          const __m256i v0 = load_half(codes + 64 * t, 0), v1 = load_half(codes + 64 * t, 1);
          step_avx2<MR>(P, _mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4), signed_codes,
                        xk + 4 * t, x.K);
          step_avx2<MR>(P, _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4), signed_codes,
                        xk + 16 + 4 * t, x.K);
        }
      } else if constexpr (ki.codes == kByte) {
        for (int s = 0; s < G / 4; ++s)
          step_avx2<MR>(P, load_half(codes + 64 * s, 0), load_half(codes + 64 * s, 1),
                        signed_codes, xk + 4 * s, x.K);
      } else {
        for (int s = 0; s < 4; ++s) {
          __m256i v[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i n = load_half(codes + 64 * (s & 1), h), pl = load_half(codes + 128, h);
            const __m256i lo = s < 2 ? _mm256_and_si256(n, low4)
                                     : _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
            const __m256i top = s == 0 ? _mm256_slli_epi16(pl, 4)
                                : s == 1 ? _mm256_slli_epi16(pl, 2)
                                : s == 2 ? pl : _mm256_srli_epi16(pl, 2);
            v[h] = _mm256_or_si256(lo, _mm256_and_si256(top, hi2));
          }
          step_avx2<MR>(P, v[0], v[1], signed_codes, xk + 4 * s, x.K);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 a, b = _mm256_setzero_ps();
        const int o = 8 * h;
        if constexpr (ki.scales == kHalf || ki.scales == kHalfMin) {
          const uint8_t* sp = codes + code_bytes(KIND);
          a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 2 * o)));
          if constexpr (ki.scales == kHalfMin)
            b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32 + 2 * o)));
        } else {
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(unit + 2 * o)));
          const uint8_t* sc = unit + (ki.scales == kK4 ? 64 : 32) + 16 * j + o;
          const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
          a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(ki.scales == kK4 ? _mm256_cvtepu8_epi32(s8)
                                                                  : _mm256_cvtepi8_epi32(s8)));
          if constexpr (ki.scales == kK4) {
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(unit + 32 + 2 * o)));
            const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 128));
            b = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8))),
                              _mm256_set1_ps(-0.f));
          }
        }
        for (int m = 0; m < MR; ++m) {
          const int64_t xb = (m0 + m) * ld32 + k0 / kXBlock;
          const __m256 t = no_contract256(_mm256_mul_ps(a, _mm256_set1_ps(x.d[xb])));
          acc[m][h] = _mm256_add_ps(
              acc[m][h], no_contract256(_mm256_mul_ps(_mm256_cvtepi32_ps(P[m][h]), t)));
          if constexpr (has_min(KIND))
            acc[m][h] = _mm256_add_ps(
                acc[m][h], no_contract256(_mm256_mul_ps(b, _mm256_set1_ps(x.xs32[xb]))));
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_out + m * kPanel + 8 * h, acc[m][h]);
}

template <int KIND>
FT_TARGET_AVX2 void panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                               int64_t M, float* y, int64_t N, const float* bias) {
  alignas(32) float acc[2 * kPanel];
  const int nv = pi.n1 - pi.n0;
  const int64_t units = x.K / kKinds[KIND].unit;
  for (int64_t m0 = 0; m0 < M; m0 += 2) {
    const int mr = static_cast<int>(std::min<int64_t>(2, M - m0));
    if (mr == 2) {
      panel_rows_avx2<2, KIND>(data, pi.c, units, x, m0, acc);
    } else {
      panel_rows_avx2<1, KIND>(data, pi.c, units, x, m0, acc);
    }
    for (int m = 0; m < mr; ++m)
      for (int o = 0; o < nv; ++o)
        y[(m0 + m) * N + pi.n0 + o] = acc[m * kPanel + o] + (bias ? bias[pi.n0 + o] : 0.f);
  }
}

FT_TARGET_AVX2 void run_panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                                   int64_t M, float* y, int64_t N, const float* bias) {
  switch (pi.kind) {
    case kNib32: return panel_avx2<kNib32>(data, pi, x, M, y, N, bias);
    case kNib32Min: return panel_avx2<kNib32Min>(data, pi, x, M, y, N, bias);
    case kByte32: return panel_avx2<kByte32>(data, pi, x, M, y, N, bias);
    case kByte32Min: return panel_avx2<kByte32Min>(data, pi, x, M, y, N, bias);
    case kNibK4: return panel_avx2<kNibK4>(data, pi, x, M, y, N, bias);
    case kByteK4: return panel_avx2<kByteK4>(data, pi, x, M, y, N, bias);
    default: return panel_avx2<kSixK6>(data, pi, x, M, y, N, bias);
  }
}

// quantize_block compiled for AVX2 (nearbyint becomes one vroundps, not a libm call).
FT_TARGET_AVX2 void quantize_blocks_avx2(const float* x, int8_t* q, float* d, int32_t* s16,
                                         float* xs, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i)
    quantize_block(x + i * kXBlock, q + i * kXBlock, d + i, s16 + 2 * i, xs + i);
}

// The machine's int8 bound: 12 independent vpdpbusd chains on registers (64 products each).
FT_TARGET_VNNI __attribute__((noinline)) int32_t vnni_chains(int64_t iters) {
  __m512i acc[12];
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) {
      acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      asm volatile("" : "+v"(acc[i]));
    }
  }
  __m512i sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, sum);
  int32_t total = 0;
  for (const int32_t v : lanes) total += v;
  return total;
}
#endif

bool cpu_has_vnni() {
#if FT_HAS_ISA_VARIANTS
  static const bool has = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

bool use_vnni() { return cpu_has_vnni() && current_isa() == Isa::kAvx512; }
// AVX2 (and AVX-512 without VNNI): the 8-lane kernel.
bool use_avx2() { return !use_vnni() && current_isa() != Isa::kBase; }

int format_id(const std::string& name) {
  for (int f = 0; f < kNumFormats; ++f)
    if (name == kFormats[f].name) return f;
  return -1;
}

// One panel's units from the rows n0..n1 of format f (the layout of GroupRef).
void fill_panel(const Format& f, const uint8_t* const* rows, int n0, int n1, int64_t K,
                uint8_t* out) {
  const int kind = f.kind;
  const KindInfo& ki = kKinds[kind];
  const int G = ki.group;
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
          unit[64 + 16 * j + o] = s.sc[j];
          unit[64 + 128 + 16 * j + o] = s.mn[j];
        } else if (ki.scales == kK6) {
          unit[32 + 16 * j + o] = s.sc[j];
        } else {
          std::memcpy(codes + code_bytes(kind) + 2 * o, &s.d, 2);
          if (ki.scales == kHalfMin) std::memcpy(codes + code_bytes(kind) + 32 + 2 * o, &s.dmin, 2);
        }
        for (int k = 0; k < G; ++k) {
          const uint8_t v = s.u[j * G + k];
          switch (ki.codes) {
            case kNib:
              codes[64 * ((k & 15) >> 2) + 4 * o + (k & 3)] |=
                  k < 16 ? v : static_cast<uint8_t>(v << 4);
              break;
            case kByte: codes[64 * (k >> 2) + 4 * o + (k & 3)] = v; break;
            default: {
              const int st = k >> 2;
              codes[64 * (st & 1) + 4 * o + (k & 3)] |=
                  st < 2 ? (v & 15) : static_cast<uint8_t>((v & 15) << 4);
              codes[128 + 4 * o + (k & 3)] |= static_cast<uint8_t>((v >> 4) << (2 * st));
            }
          }
        }
      }
    }
  }
}

}  // namespace

std::vector<std::string> int8_matrix_types() {
  std::vector<std::string> out;
  for (const Format& f : kFormats) out.emplace_back(f.name);
  return out;
}

bool int8_vnni_available() { return cpu_has_vnni(); }

bool is_int8_matrix(const at::Tensor& weight) {
  if (!weight.defined() || !weight.device().is_cpu() || weight.scalar_type() != at::kByte ||
      weight.dim() != 1 || weight.numel() < kHeaderBytes)
    return false;
  int32_t magic;
  std::memcpy(&magic, weight.data_ptr(), 4);
  return magic == kMagic;
}

std::vector<int64_t> int8_matrix_shape(const at::Tensor& weight) {
  const Matrix m = read_matrix(weight, "int8_matrix_shape");
  return {m.N, m.K};
}

at::Tensor int8_matrix_pack(const at::Tensor& base, const at::Tensor& row_offsets,
                            const std::vector<std::string>& types,
                            const std::vector<int64_t>& ends, int64_t K) {
  TORCH_CHECK_VALUE(base.device().is_cpu() && base.scalar_type() == at::kByte && base.dim() == 1,
                    "int8_matrix: base must be a 1-D uint8 CPU tensor (the file's mapping)");
  TORCH_CHECK_VALUE(row_offsets.device().is_cpu() && row_offsets.scalar_type() == at::kLong &&
                        row_offsets.dim() == 1 && row_offsets.numel() >= 1,
                    "int8_matrix: row_offsets must be a 1-D int64 CPU tensor [N >= 1]");
  const int64_t N = row_offsets.numel();
  TORCH_CHECK_VALUE(!types.empty() && types.size() == ends.size() && ends.back() == N,
                    "int8_matrix: types and ends are one per segment, the last end N = ", N);
  TORCH_CHECK_VALUE(K >= 32 && K <= INT32_MAX && N <= INT32_MAX, "int8_matrix: bad K ", K);
  const at::Tensor off = row_offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const uint8_t* b = base.data_ptr<uint8_t>();
  std::vector<const uint8_t*> rows(N);
  std::vector<PanelInfo> panels;
  std::vector<int> panel_format;
  int64_t start = 0, bytes = kHeaderBytes;
  for (size_t s = 0; s < types.size(); ++s) {
    const int f = format_id(types[s]);
    TORCH_CHECK_VALUE(f >= 0, "int8_matrix: no int8 kernel for GGUF type ", types[s]);
    const Format& fmt = kFormats[f];
    TORCH_CHECK_VALUE(K % fmt.values == 0, "int8_matrix: a ", types[s], " row holds a multiple ",
                      "of ", fmt.values, " weights, not ", K);
    TORCH_CHECK_VALUE(ends[s] > start && ends[s] <= N, "int8_matrix: segment ends must rise");
    const int64_t row_bytes = K / fmt.values * fmt.bytes;
    for (int64_t n = start; n < ends[s]; ++n) {
      TORCH_CHECK_VALUE(o[n] >= 0 && o[n] + row_bytes <= base.numel(), "int8_matrix: row ", n,
                        " at byte ", o[n], " (", row_bytes, " bytes) lies outside base (",
                        base.numel(), " bytes)");
      rows[n] = b + o[n];
    }
    for (int64_t n = start; n < ends[s]; n += kPanel) {
      panels.push_back({fmt.kind, static_cast<int32_t>(n),
                        static_cast<int32_t>(std::min<int64_t>(ends[s], n + kPanel)), fmt.c, 0});
      panel_format.push_back(f);
    }
    start = ends[s];
  }
  const int64_t P = static_cast<int64_t>(panels.size());
  bytes += (P * static_cast<int64_t>(sizeof(PanelInfo)) + 63) / 64 * 64;
  for (PanelInfo& pi : panels) {
    pi.offset = bytes;
    bytes += (K / kKinds[pi.kind].unit * unit_bytes(pi.kind) + 63) / 64 * 64;
  }
  at::Tensor out = at::zeros({bytes}, base.options());
  uint8_t* p = out.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, "int8_matrix: unaligned allocation");
  const int32_t h[5] = {kMagic, kVersion, static_cast<int32_t>(N), static_cast<int32_t>(K),
                        static_cast<int32_t>(P)};
  std::memcpy(p, h, sizeof h);
  std::memcpy(p + kHeaderBytes, panels.data(), P * sizeof(PanelInfo));
  TaskPool::get().run(P, at::get_num_threads(), [&](int64_t i) {
    const PanelInfo& pi = panels[i];
    fill_panel(kFormats[panel_format[i]], rows.data(), pi.n0, pi.n1, K, p + pi.offset);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_matrix_unpack(
    const at::Tensor& weight) {
  const Matrix mat = read_matrix(weight, "int8_matrix_unpack");
  const int64_t N = mat.N, K = mat.K;
  at::Tensor u = at::empty({N, K}, weight.options());
  at::Tensor a = at::empty({N, K / 16}, weight.options().dtype(at::kFloat));
  at::Tensor b = at::zeros({N, K / 16}, weight.options().dtype(at::kFloat));
  at::Tensor c = at::empty({N}, weight.options().dtype(at::kInt));
  for (int64_t p = 0; p < mat.P; ++p) {
    const PanelInfo& pi = mat.panels[p];
    const KindInfo& ki = kKinds[pi.kind];
    const int G = ki.group;
    for (int64_t un = 0; un < K / ki.unit; ++un) {
      for (int j = 0; j < ki.unit / G; ++j) {
        const GroupRef gr{pi.kind, mat.base + pi.offset + un * unit_bytes(pi.kind), j};
        const int64_t k0 = un * ki.unit + j * G;
        for (int o = 0; o < pi.n1 - pi.n0; ++o) {
          const int64_t n = pi.n0 + o;
          for (int k = 0; k < G; ++k)
            u.data_ptr<uint8_t>()[n * K + k0 + k] = static_cast<uint8_t>(gr.code(o, k));
          float ga, gb;
          gr.scales(o, &ga, &gb);
          for (int i = 0; i < G / 16; ++i) {
            a.data_ptr<float>()[n * (K / 16) + k0 / 16 + i] = ga;
            b.data_ptr<float>()[n * (K / 16) + k0 / 16 + i] = gb;
          }
          c.data_ptr<int32_t>()[n] = pi.c;
        }
      }
    }
  }
  return {u, a, b, c};
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.is_contiguous() && x.size(1) % kXBlock == 0,
                    "int8_quantize_rows: x must be a contiguous [M, K] fp32 CPU tensor, K a "
                    "multiple of 32");
  ActStore s = quantize(x);
  return {s.q, s.d};
}

at::Tensor int8_matrix_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) {
  const Matrix mat = read_matrix(weight, "int8_linear");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.is_contiguous(),
                    "int8_linear: x must be a contiguous 2-D fp32 CPU tensor [M, K]");
  TORCH_CHECK_VALUE(x.size(1) == mat.K, "int8_linear: x has K = ", x.size(1),
                    ", the weight has K = ", mat.K);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                          bias->dim() == 1 && bias->size(0) == mat.N && bias->is_contiguous(),
                      "int8_linear: bias must be a contiguous fp32 CPU tensor [", mat.N, "]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, mat.N}, x.options());
  if (M == 0) return y;
  const ActStore store = quantize(x);
  const Acts acts = store.view();
  float* yp = y.data_ptr<float>();
  const bool vnni = use_vnni(), avx2 = use_avx2();
  const auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const PanelInfo& pi = mat.panels[p];
#if FT_HAS_ISA_VARIANTS
      if (vnni) {
        run_panel_vnni(mat.base + pi.offset, pi, acts, M, yp, mat.N, b);
        continue;
      }
      if (avx2) {
        run_panel_avx2(mat.base + pi.offset, pi, acts, M, yp, mat.N, b);
        continue;
      }
#endif
      panel_portable(mat.base + pi.offset, pi, acts, M, yp, mat.N, b);
    }
  };
  // One thread's time, roughly: ~1 byte a weight at ~20 GB/s, or ~300 G int8 products/s.
  const double est_ns = std::max(static_cast<double>(mat.N) * mat.K / 20.0,
                                 static_cast<double>(M) * mat.N * mat.K / 300.0);
  const int nthreads = est_ns < panel::kInlineNs ? 1 : at::get_num_threads();
  const int64_t n = std::min<int64_t>(nthreads == 1 ? 1 : 4 * nthreads, mat.P);
  TaskPool::get().run(n, nthreads, [&](int64_t t) { run(mat.P * t / n, mat.P * (t + 1) / n); });
  return y;
}

double int8_peak_gops(int64_t iters, int64_t threads) {
  TORCH_CHECK_VALUE(cpu_has_vnni(), "int8_peak_gops: this CPU has no AVX512-VNNI");
#if FT_HAS_ISA_VARIANTS
  std::atomic<int32_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  TaskPool::get().run(threads, static_cast<int>(threads),
                      [&](int64_t) { sink += vnni_chains(iters); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 64 * 12 * static_cast<double>(iters) * threads / s / 1e9;
#else
  return 0;
#endif
}

}  // namespace freetoken
