// The int8 mode's kernels: the arithmetic of int8_linear.cpp's module comment, three times with
// the same bits. The portable loop is the reference order (and the baseline x86-64 variant); the
// AVX512-VNNI and AVX2 loops keep 16 outputs in vector lanes. Not the layout (int8_layout.h) nor
// the choice among them (int8_linear.cpp).
#include "linear/int8_kernels.h"

#include <immintrin.h>

#include "linear/int8_vnni.h"

namespace freetoken {
namespace int8 {

// fp32 products kept apart from the adds that follow (the file builds with -ffp-contract=fast):
// the arithmetic of the module comment, not an FMA of it.
FT_INLINE float no_contract(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#else
  volatile float kept = v;
  v = kept;
#endif
  return v;
}

// --- the portable kernel (the reference order; the baseline x86-64 variant) ------------------

// One K-quant unit of output o, row m: the superblock's fp32 step onto acc.
FT_INLINE float superblock_portable(const uint8_t* unit, int kind, int o, int32_t c,
                                   const Acts& x, int64_t m, int64_t u, float acc) {
  const KindInfo& ki = kKinds[kind];
  const bool k4 = ki.scales == kK4;
  const int G = ki.group, per = 256 / G;
  const int8_t* xq = x.q + m * x.K + u * 256;
  int32_t I = 0, S = 0;
  for (int j = 0; j < per; ++j) {
    const GroupRef gr{kind, unit, j};
    int32_t P = 0;
    for (int k = 0; k < G; ++k) P += gr.code(o, k) * xq[j * G + k];
    I += gr.sc(o) * P;
    const int32_t sx = G == 32 ? x.s32[m * (x.K / 32) + u * 8 + j]   // x's sum over the group
                               : x.s16[m * (x.K / 16) + u * 16 + j];
    S += (k4 ? gr.mn(o) : gr.sc(o)) * sx;
  }
  if (!k4) I -= c * S;
  const float dx = x.d[m * (x.K / kXBlock) + u * 8];
  const float t = no_contract(gb::half_to_float(unit + 2 * o) * dx);
  acc = acc + no_contract(static_cast<float>(I) * t);
  if (k4) {
    const float t2 = no_contract(-gb::half_to_float(unit + 32 + 2 * o) * dx);
    acc = acc + no_contract(static_cast<float>(S) * t2);
  }
  return acc;
}

void panel_portable(const uint8_t* data, const PanelInfo& pi, const Acts& x, int64_t M, float* y,
                    int64_t N, const float* bias) {
  const KindInfo& ki = kKinds[pi.kind];
  const int64_t units = x.K / ki.unit, ld32 = x.K / kXBlock;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    const int8_t* xq = x.q + m * x.K;
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* unit = data + u * unit_bytes(pi.kind);
      if (ki.unit == 256) {
        for (int o = 0; o < kPanel; ++o)
          acc[o] = superblock_portable(unit, pi.kind, o, pi.c, x, m, u, acc[o]);
        continue;
      }
      const GroupRef gr{pi.kind, unit, 0};
      const int64_t k0 = u * 32;
      const int32_t S = x.s32[m * ld32 + k0 / 32];
      const float d = x.d[m * ld32 + k0 / kXBlock];
      for (int o = 0; o < kPanel; ++o) {
        int32_t P = -pi.c * S;
        for (int k = 0; k < 32; ++k) P += gr.code(o, k) * xq[k0 + k];
        float a, b;
        gr.scales(o, &a, &b);
        const float t = no_contract(a * d);
        acc[o] = acc[o] + no_contract(static_cast<float>(P) * t);
        if (has_min(pi.kind)) acc[o] = acc[o] + no_contract(b * x.xs32[m * ld32 + k0 / kXBlock]);
      }
    }
    store_rows(acc, 1, m, pi, y, N, bias);
  }
}

// --- the VNNI kernel -----------------------------------------------------------------------------
#if FT_HAS_ISA_VARIANTS
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

// The sums of 16 vectors' lanes, sum i in lane i: pairs of vectors added lane-interleaved, four
// times (46 uops against 16 hsum's ~140).
FT_TARGET_VNNI FT_INLINE __m512i sums16(__m512i (&v)[16]) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: v[2i] 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // 128-bit lane: v[4i .. 4i + 3], each that lane's sum
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // lanes 0, 1: b[2i]'s halves added; 2, 3: b[2i + 1]'s
    c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xDD));
  // lane L of the last add: v[4 L .. 4 L + 3], 128-bit lanes in order
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88),
                          _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
}

// A finite superblock of 256 values (at xb, block blk) through quantize_block's arithmetic: its
// 8 blocks of 32 share id and d, so their 16 sums of 16 are taken together.
FT_TARGET_VNNI FT_INLINE void quantize_superblock(const float* xb, __m512 id, float d,
                                                  const ActsOut& o, int64_t blk) {
  __m512i q[16];
  for (int h = 0; h < 16; ++h) {
    q[h] = _mm512_maskz_cvtps_epi32(0xFFFF, _mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o.q + blk * 256 + 16 * h),
                     _mm512_maskz_cvtepi32_epi8(0xFFFF, q[h]));
  }
  const __m512i s16 = sums16(q);  // lane h: the sum of q[h] (16 values)
  const int64_t i0 = blk * 8;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.s16 + 2 * i0),
                      _mm512_maskz_cvtepi32_epi16(0xFFFF, s16));
  // s32 (block i: lanes 2 i + 2 i + 1) in the low 8 lanes
  const __m512i idx = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i pairs = _mm512_permutexvar_epi32(idx, s16);
  const __m256i s32 = _mm256_add_epi32(_mm512_castsi512_si256(pairs),
                                       _mm512_extracti32x8_epi32(pairs, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o.s32 + i0), _mm256_cvtepi32_epi16(s32));
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_storeu_ps(o.d + i0, dv);
  _mm256_storeu_ps(o.xs32 + i0, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(s32)));
}

// quantize_block's arithmetic, 16 lanes at a time (cvtps2dq rounds to nearest even, as
// nearbyint does); a block with a NaN or an infinity takes quantize_block itself.
FT_TARGET_VNNI void quantize_blocks_vnni(const float* x, int B, const ActsOut& o, int64_t b0,
                                         int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const float* xb = x + blk * B;
    __m512 amaxv = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int v = 0; v < B; v += 16) {
      const __m512 a = _mm512_loadu_ps(xb + v);
      bad |= _mm512_fpclass_ps_mask(a, 0x99);
      amaxv = _mm512_maskz_max_ps(0xFFFF, amaxv, _mm512_abs_ps(a));
    }
    if (bad) {
      quantize_block(x, B, o, blk);
      continue;
    }
    const float amax = hmax(amaxv);
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    if (B == 256) {
      quantize_superblock(xb, id, amax / 127.f, o, blk);
      continue;
    }
    for (int64_t i = blk * (B / kXBlock); i < (blk + 1) * (B / kXBlock); ++i) {
      const float* xi = x + i * kXBlock;
      const __m512i qa = _mm512_maskz_cvtps_epi32(0xFFFF, _mm512_mul_ps(_mm512_loadu_ps(xi), id));
      const __m512i qb =
          _mm512_maskz_cvtps_epi32(0xFFFF, _mm512_mul_ps(_mm512_loadu_ps(xi + 16), id));
      auto* qi = reinterpret_cast<__m128i*>(o.q + i * kXBlock);
      _mm_storeu_si128(qi, _mm512_maskz_cvtepi32_epi8(0xFFFF, qa));
      _mm_storeu_si128(qi + 1, _mm512_maskz_cvtepi32_epi8(0xFFFF, qb));
      o.d[i] = amax / 127.f;
      store_sums(o, i, hsum(qa), hsum(qb));
    }
  }
}

// NOTE: a panel streams from DRAM once a step: the bytes kPrefetchBytes ahead of the group being
// read are asked for (1B Q4_K ffn_gate at 8 rows, one thread: 5.8-6.2 -> 4.1-4.4 ms). The AVX2
// loop too (Zen 3, 8192 x 2048 from DRAM, one row: Q4_K 0.77-0.89x the time, Q6_K 0.82x; 4096
// ahead read the same as 2048). Into L2 (prefetcht1), as the exact mode's block panels: on an
// Intel AMX host, one row from DRAM, two threads, Q4_K 8192 x 2048 0.79x the time of prefetcht0
// (15.4 -> 19.6 GB/s), Q6_K 2048 x 8192 0.90x, 8 rows and the 32-value formats level; at 224
// rows (hot) 0.81x and 0.91x (likely: the panel's next bytes no longer evict x's rows from L1).
constexpr int64_t kPrefetchBytes = 2048;

// The 4 codes of x's row m0 + m at k (a multiple of 4): from the row, or (TILED) from the tile
// copy, where a tile's rows share one base address.
template <bool TILED>
FT_INLINE const int8_t* x_at(const Acts& x, int64_t m0, int m, int64_t k) {
  if constexpr (TILED) {
    return reinterpret_cast<const int8_t*>(
        x.qt + ((m0 / kTileRows) * (x.K / 4) + k / 4) * kTileRows + m);
  } else {
    return x.q + (m0 + m) * x.K + k;
  }
}

// P[m] += one group's codes . rows m0 + m of x at k0 (16 output lanes, exact int32).
template <int MR, int KIND, bool TILED = false>
FT_TARGET_VNNI FT_INLINE void group_dots(const uint8_t* codes, const Acts& x, int64_t m0,
                                         int64_t k0, __m512i (&P)[MR]) {
  constexpr KindInfo ki = kKinds[KIND];
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (ki.codes == kNib || ki.codes == kLut) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * t);
      __m512i lo = _mm512_and_si512(v, low4);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (ki.codes == kLut) {
        lo = _mm512_shuffle_epi8(iq4_codes512(), lo);
        hi = _mm512_shuffle_epi8(iq4_codes512(), hi);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        P[m] = dot4(P[m], lo, x_at<TILED>(x, m0, m, k0 + 4 * t));
        P[m] = dot4(P[m], hi, x_at<TILED>(x, m0, m, k0 + 16 + 4 * t));
      }
    }
  } else if constexpr (ki.codes == kByte) {
#pragma GCC unroll 16
    for (int s = 0; s < ki.group / 4; ++s) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * s);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) P[m] = dot4(P[m], v, x_at<TILED>(x, m0, m, k0 + 4 * s));
    }
  } else {
    __m512i v[4];
    if constexpr (ki.codes == kSix) six_bit_steps(codes, v);
    else low_bit_steps<ki.codes>(codes, v);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) P[m] = dot4(P[m], v[s], x_at<TILED>(x, m0, m, k0 + 4 * s));
    }
  }
}

FT_INLINE void prefetch_to(const uint8_t*& prefetched, const uint8_t* end) {
  for (; prefetched < end + kPrefetchBytes; prefetched += 64) __builtin_prefetch(prefetched, 0, 2);
}

// Rows [m0, m0 + MR) against one panel of a 32-value format (its own scales a group) over K.
template <int MR, int KIND>
FT_TARGET_VNNI FT_INLINE void panel_rows_vnni(const uint8_t* data, int32_t c, int64_t units,
                                              const Acts& x, int64_t m0, float* acc_out) {
  static_assert(kKinds[KIND].unit == 32 && kKinds[KIND].group == 32,
                "the K-quants take panel_rows_vnni_k");
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* prefetched = data;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* codes = data + u * unit_bytes(KIND);
    prefetch_to(prefetched, codes + group_bytes(KIND));
    __m512i P[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) P[m] = _mm512_setzero_si512();
    group_dots<MR, KIND>(codes, x, m0, u * 32, P);
    group_step<MR, KIND>(codes, c, x, m0, u, P, acc);
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc_out + m * kPanel, acc[m]);
}

// Rows [m0, m0 + MR) against one K-quant panel (x quantized per 256): the superblock's arithmetic
// of int8_linear.cpp's module comment, its sums in integer and one fp32 step a superblock.
template <int MR, int KIND, bool TILED>
FT_TARGET_VNNI FT_INLINE void panel_rows_vnni_k(const uint8_t* data, int32_t c, int64_t units,
                                                const Acts& x, int64_t m0, float* acc_out) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int G = ki.group, PER = 256 / G;
  static_assert(ki.unit == 256, "a K-quant kind");
  // The fp32 sums live in acc_out (L1), touched once a superblock: the registers go to the
  // integer sums, so that MR rows make MR independent vpdpbusd chains.
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc_out + m * kPanel, _mm512_setzero_ps());
  const uint8_t* prefetched = data;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = data + u * unit_bytes(KIND);
    __m512i I[MR];
    for (int m = 0; m < MR; ++m) I[m] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int j = 0; j < PER; ++j) {
      const uint8_t* codes = unit + head_bytes(KIND) + j * group_bytes(KIND);
      prefetch_to(prefetched, codes + group_bytes(KIND));
      __m512i P[MR];
      for (int m = 0; m < MR; ++m) P[m] = _mm512_setzero_si512();
      group_dots<MR, KIND, TILED>(codes, x, m0, u * 256 + j * G, P);
      add_scaled<MR, KIND>(unit, j, P, I);
    }
    superblock_step<MR, KIND>(unit, c, RowsX(x, m0, u, G == 32), I, acc_out);
  }
}

constexpr int kVnniRows = 8;  // rows a register tile: 8 int32 sums + 8 fp32 accumulators
constexpr int kVnniRowsK = kTileRows;  // the K-quants': 12 group sums + 12 superblock sums

template <int KIND, int MR>
FT_TARGET_VNNI FT_INLINE void rows_dispatch(int mr, const uint8_t* data, int32_t c, int64_t units,
                                            const Acts& x, int64_t m0, float* acc) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_dispatch<KIND, MR - 1>(mr, data, c, units, x, m0, acc);
  }
  if constexpr (kKinds[KIND].unit == 256) {
    if (x.qt) return panel_rows_vnni_k<MR, KIND, true>(data, c, units, x, m0, acc);
    panel_rows_vnni_k<MR, KIND, false>(data, c, units, x, m0, acc);
  } else {
    panel_rows_vnni<MR, KIND>(data, c, units, x, m0, acc);
  }
}

template <int KIND>
FT_TARGET_VNNI void panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                               int64_t M, float* y, int64_t N, const float* bias) {
  constexpr int R = kKinds[KIND].unit == 256 ? kVnniRowsK : kVnniRows;
  alignas(64) float acc[R * kPanel];
  const int64_t units = x.K / kKinds[KIND].unit;
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    const int mr = static_cast<int>(std::min<int64_t>(R, M - m0));
    rows_dispatch<KIND, R>(mr, data, pi.c, units, x, m0, acc);
    store_rows(acc, mr, m0, pi, y, N, bias);
  }
}

FT_TARGET_VNNI void run_panel_vnni(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                                   int64_t M, float* y, int64_t N, const float* bias) {
  with_kind(pi.kind, [&](auto kind) {
    panel_vnni<decltype(kind)::value>(data, pi, x, M, y, N, bias);
  });
}

// --- the AVX2 kernel (CPUs without AVX512-VNNI) -----------------------------------------------
// The same layout and arithmetic with 8-lane vectors: a panel is two halves of 8 outputs, and
// each 4-code step is vpmaddubsw (u8 x s8 -> pairs of int16). The pairs of several steps are
// summed in int16 and widened once by vpmaddwd by ones (-> int32): both multiplies take the
// same two ports (Zen 3), so this does 1 + 1 / n of them a step instead of 2. Exact: x is in
// [-127, 127] (|x| <= 128 at worst), so a pair is at most 2 * 128 * max_code and n steps of
// them stay under 2^15 while n * max_code <= 127 (int16_steps). Q8_0's biased codes are unbiased
// first, its products taken as |q| x sign(q) * x (|pair| <= 32768 - 256): one step at a time.
//
// With AVX-VNNI (Alder Lake and later cores without AVX-512, Sierra Forest) a step is one
// vpdpbusd a row and half into int32 sums (DP): no int16 sums, no widening, the same integer
// sums and so the same bits. A K-quant group's sum then takes its scale by vpmulld, and Q8_0
// keeps its biased codes (less 128 times x's sums, as the other byte codes).
FT_TARGET_AVX2 FT_INLINE __m256 no_contract256(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

FT_TARGET_AVX2 FT_INLINE __m256i bcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + the 4-byte dot products of u (unsigned) and v (signed) in each int32 lane: AVX-VNNI's
// vpdpbusd (VEX). NOTE: in asm, so that the AVX2 loop's functions keep their AVX2 target (a
// target with avxvnni would let GCC emit it where the CPU has none); called only where it has.
FT_INLINE __m256i dpbusd_vex(__m256i acc, __m256i u, __m256i v) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(v));
  return acc;
}

FT_TARGET_AVX2 FT_INLINE __m256i load_half(const uint8_t* p, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
}

// Steps of a kind's unsigned codes whose int16 pair sums cannot overflow (the comment above),
// at most a group's: 4-bit codes 8 (a whole group), 5-bit (Q5_0, Q5_1, Q5_K) 4, 6-bit (Q6_K) 2,
// 2- and 3-bit (Q2_K, Q3_K) 4 (a whole group of 16).
template <int KIND>
constexpr int int16_steps() {
  constexpr int max_code = kKinds[KIND].codes == kByte ? 31 : (1 << code_bits(KIND)) - 1;
  constexpr int n = 127 / max_code >= 8 ? 8 : 127 / max_code >= 4 ? 4 : 2;
  return n < kKinds[KIND].group / 4 ? n : kKinds[KIND].group / 4;
}

// A 2-bit or 3-bit group's codes (low_bit_steps' layout) for half h: vector s holds codes
// 4 s .. 4 s + 3 of outputs 8 h .. 8 h + 7.
template <int CODES>
FT_TARGET_AVX2 FT_INLINE void low_bit_steps_avx2(const uint8_t* codes, int h, __m256i (&v)[4]) {
  const __m256i low2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * h));
  v[0] = _mm256_and_si256(plane, low2);
  v[1] = _mm256_and_si256(_mm256_srli_epi16(plane, 2), low2);
  v[2] = _mm256_and_si256(_mm256_srli_epi16(plane, 4), low2);
  v[3] = _mm256_and_si256(_mm256_srli_epi16(plane, 6), low2);
  if constexpr (CODES == kThree) {
    const __m256i w = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 64 + 16 * h)));
    const __m256i hb = _mm256_or_si256(w, _mm256_slli_epi16(w, 4));
    v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit2));
    v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit2));
    v[2] = _mm256_or_si256(v[2], _mm256_and_si256(hb, bit2));
    v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit2));
  }
}

// Half h (outputs 8 h .. 8 h + 7) of groups 2 p and 2 p + 1 of a unit's 8-bit numbers (at g) as
// int16 pairs, lane o = (g[2 p][o], g[2 p + 1][o]): vpmaddwd's operand.
FT_TARGET_AVX2 FT_INLINE __m256i group_pairs_avx2(const uint8_t* g, int p, int h, bool is_signed) {
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 32 * p + 8 * h));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 32 * p + 16 + 8 * h));
  const __m128i ab = _mm_unpacklo_epi8(a, b);
  return is_signed ? _mm256_cvtepi8_epi16(ab) : _mm256_cvtepu8_epi16(ab);
}

// Half h of a group's 8-bit scales (at sc) with each output's scale in both int16 of its lane:
// vpmaddwd of the group's int16 pair sums by it is the group's integer dot times its scale.
FT_TARGET_AVX2 FT_INLINE __m256i scale_pairs_avx2(const uint8_t* sc, int h, bool is_signed) {
  const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h));
  const __m128i twice = _mm_unpacklo_epi8(s8, s8);
  return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

// Rows [m0, m0 + MR) against one panel; acc_out [MR][16]. A 4-code step is vpmaddubsw per row
// and half onto int16 sums Q, widened every int16_steps steps by vpmaddwd: by ones into the
// group's int32 sums P, or, for a K-quant, by the group's scale pairs straight into the
// superblock's sum I (sc * P, no vpmulld). SIGNED: codes offset by 128 (Q8_0, IQ4_NL, IQ4_XS),
// one step at a time, the offset taken off the codes (no sums of x). DP: each step one vpdpbusd
// into the group's int32 sums P (AVX-VNNI), a K-quant's then times its scales.
template <int MR, int KIND, bool SIGNED, bool DP>
FT_TARGET_AVX2 FT_INLINE void panel_rows_avx2(const uint8_t* data, int32_t c, int64_t units,
                                              const Acts& x, int64_t m0, float* acc_out) {
  constexpr KindInfo ki = kKinds[KIND];
  constexpr int G = ki.group, PER = ki.unit / G;
  constexpr bool kq = ki.unit == 256, k4 = ki.scales == kK4;
  constexpr int n16 = SIGNED ? 1 : int16_steps<KIND>();
  static_assert(!SIGNED || KIND == kByte32 || ki.codes == kLut, "codes offset by 128");
  // a K-quant's sums of x over its groups, for its mins or its offset
  constexpr bool second_sum = k4 || !SIGNED;
  const int64_t ld16 = x.K / 16, ld32 = x.K / kXBlock;
  const __m256i low4 = _mm256_set1_epi8(15), hi2 = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  // the panel streams from DRAM in the first row group only; the others find it in L2
  const bool from_dram = m0 == 0;
  const uint8_t* prefetched = data;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = data + u * unit_bytes(KIND);
    const uint8_t* sc = unit + sc_offset(KIND);  // K-quants: [PER][16] (Q6_K: int8)
    __m256i I[MR][2];
    for (int m = 0; m < MR; ++m) I[m][0] = I[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < PER; ++j) {
      const uint8_t* codes = unit + head_bytes(KIND) + j * group_bytes(KIND);
      if (from_dram) prefetch_to(prefetched, codes + group_bytes(KIND));
      const int64_t k0 = u * ki.unit + j * G;
      const int8_t* xk = x.q + m0 * x.K + k0;
      __m256i sc16[2], P[MR][2], Q[MR][2];
      if constexpr (kq) {
        for (int h = 0; h < 2; ++h) sc16[h] = scale_pairs_avx2(sc + 16 * j, h, !k4);
        if constexpr (DP)
          for (int m = 0; m < MR; ++m) P[m][0] = P[m][1] = _mm256_setzero_si256();
      } else {
        for (int m = 0; m < MR; ++m) {
          int32_t init = 0;
          if (!has_min(KIND) && !SIGNED) init = -c * x.s32[(m0 + m) * ld32 + k0 / 32];
          P[m][0] = P[m][1] = _mm256_set1_epi32(init);
        }
      }
      int steps = 0;
      // One step: 4 codes of each output (halves cv) times the 4 x at k0 + dk of each row.
      const auto step = [&](__m256i lo8, __m256i hi8,
                            int dk) FT_TARGET_AVX2 __attribute__((always_inline)) {
        __m256i cv[2] = {lo8, hi8}, sg[2] = {lo8, hi8};
        if constexpr (SIGNED) {
          for (int h = 0; h < 2; ++h) {
            sg[h] = _mm256_xor_si256(cv[h], bias);  // u - 128
            cv[h] = _mm256_abs_epi8(sg[h]);
          }
        }
        const bool first = steps % n16 == 0;  // of the steps Q sums (known once unrolled)
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = bcast4_256(xk + m * x.K + dk);
          for (int h = 0; h < 2; ++h) {
            const __m256i xs = SIGNED ? _mm256_sign_epi8(xv, sg[h]) : xv;
            if constexpr (DP) {
              P[m][h] = dpbusd_vex(P[m][h], cv[h], xs);
              continue;
            }
            const __m256i pairs = _mm256_maddubs_epi16(cv[h], xs);
            Q[m][h] = first ? pairs : _mm256_add_epi16(Q[m][h], pairs);
          }
        }
        if (DP || ++steps % n16 != 0) return;
        for (int m = 0; m < MR; ++m)
          for (int h = 0; h < 2; ++h) {
            if constexpr (kq) {
              I[m][h] = _mm256_add_epi32(I[m][h], _mm256_madd_epi16(Q[m][h], sc16[h]));
            } else {
              P[m][h] = _mm256_add_epi32(P[m][h], _mm256_madd_epi16(Q[m][h], ones));
            }
          }
      };
      if constexpr (ki.codes == kNib) {
        for (int t = 0; t < 4; ++t) {
          const __m256i v0 = load_half(codes + 64 * t, 0), v1 = load_half(codes + 64 * t, 1);
          step(_mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4), 4 * t);
          step(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
               _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4), 16 + 4 * t);
        }
      } else if constexpr (ki.codes == kLut) {
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Codes)));
        const auto look = [&](__m256i v) FT_TARGET_AVX2 __attribute__((always_inline)) {
          return _mm256_shuffle_epi8(table, v);
        };
        for (int t = 0; t < 4; ++t) {
          const __m256i v0 = load_half(codes + 64 * t, 0), v1 = load_half(codes + 64 * t, 1);
          step(look(_mm256_and_si256(v0, low4)), look(_mm256_and_si256(v1, low4)), 4 * t);
          step(look(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4)),
               look(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4)), 16 + 4 * t);
        }
      } else if constexpr (ki.codes == kByte) {
        for (int t = 0; t < G / 4; ++t)
          step(load_half(codes + 64 * t, 0), load_half(codes + 64 * t, 1), 4 * t);
      } else if constexpr (ki.codes == kTwo || ki.codes == kThree) {
        __m256i v[2][4];
        for (int h = 0; h < 2; ++h) low_bit_steps_avx2<ki.codes>(codes, h, v[h]);
        for (int t = 0; t < 4; ++t) step(v[0][t], v[1][t], 4 * t);
      } else {
        for (int t = 0; t < 4; ++t) {
          __m256i v[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i n = load_half(codes + 64 * (t & 1), h), pl = load_half(codes + 128, h);
            const __m256i lo = t < 2 ? _mm256_and_si256(n, low4)
                                     : _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
            const __m256i top = t == 0 ? _mm256_slli_epi16(pl, 4)
                                : t == 1 ? _mm256_slli_epi16(pl, 2)
                                : t == 2 ? pl : _mm256_srli_epi16(pl, 2);
            v[h] = _mm256_or_si256(lo, _mm256_and_si256(top, hi2));
          }
          step(v[0], v[1], 4 * t);
        }
      }
      if constexpr (kq && DP) {  // the group's sums times its scales (int32 a lane)
        for (int h = 0; h < 2; ++h) {
          const __m128i s8 =
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * j + 8 * h));
          const __m256i scv = k4 ? _mm256_cvtepu8_epi32(s8) : _mm256_cvtepi8_epi32(s8);
          for (int m = 0; m < MR; ++m)
            I[m][h] = _mm256_add_epi32(I[m][h], _mm256_mullo_epi32(P[m][h], scv));
        }
      }
      if constexpr (kq) continue;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* sp = codes + code_bytes(KIND);
        const __m256 a =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16 * h)));
        __m256 b = _mm256_setzero_ps();
        if constexpr (ki.scales == kHalfMin)
          b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32 + 16 * h)));
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
    if constexpr (kq) {  // the superblock's second integer sum and its fp32 step
      for (int h = 0; h < 2; ++h) {
        __m256i S[MR];
        for (int m = 0; m < MR; ++m) S[m] = _mm256_setzero_si256();
        for (int p = 0; second_sum && p < PER / 2; ++p) {
          const __m256i pairs = group_pairs_avx2(k4 ? unit + min_offset(KIND) : sc, p, h, !k4);
          for (int m = 0; m < MR; ++m) {
            const int16_t* sx = G == 32 ? x.s32 + (m0 + m) * ld32 + u * 8 + 2 * p
                                        : x.s16 + (m0 + m) * ld16 + u * 16 + 2 * p;
            int32_t word;
            std::memcpy(&word, sx, 4);
            S[m] = _mm256_add_epi32(S[m], _mm256_madd_epi16(pairs, _mm256_set1_epi32(word)));
          }
        }
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 16 * h)));
        const __m256 nmin = _mm256_xor_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 32 + 16 * h))),
            _mm256_set1_ps(-0.f));
        for (int m = 0; m < MR; ++m) {
          const __m256 dx = _mm256_set1_ps(x.d[(m0 + m) * ld32 + u * 8]);
          __m256i Iv = I[m][h];
          if constexpr (!k4 && second_sum)
            Iv = _mm256_sub_epi32(Iv, _mm256_mullo_epi32(S[m], _mm256_set1_epi32(c)));
          const __m256 t = no_contract256(_mm256_mul_ps(d, dx));
          acc[m][h] = _mm256_add_ps(
              acc[m][h], no_contract256(_mm256_mul_ps(_mm256_cvtepi32_ps(Iv), t)));
          if constexpr (k4) {
            const __m256 t2 = no_contract256(_mm256_mul_ps(nmin, dx));
            acc[m][h] = _mm256_add_ps(
                acc[m][h], no_contract256(_mm256_mul_ps(_mm256_cvtepi32_ps(S[m]), t2)));
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_out + m * kPanel + 8 * h, acc[m][h]);
}

template <int KIND, bool SIGNED, bool DP>
FT_TARGET_AVX2 void panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                               int64_t M, float* y, int64_t N, const float* bias) {
  // 4-bit codes take 4 rows a tile, sharing each step's decode (Q4_K at 224 rows: 0.84x the
  // time of 2 rows); the wider codes keep 2, whose sums already fill the 16 registers, except
  // with AVX-VNNI (no int16 sums: 4 rows took Q6_K 0.86-0.92x the time of 2 at 8-224 rows, Q5_K
  // at 8 rows 0.82-0.85x, level from 64). The 2- and 3-bit codes (Q2_K, Q3_K) take 4 as the
  // 4-bit ones do, their int16 sums widened once a group as well (not measured against 2).
  constexpr int kCodes = kKinds[KIND].codes;
  constexpr int kRows = kCodes == kNib || kCodes == kTwo || kCodes == kThree || DP ? 4 : 2;
  alignas(32) float acc[4 * kPanel];
  const int64_t units = x.K / kKinds[KIND].unit;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
    if (mr == 4) {
      panel_rows_avx2<kRows == 4 ? 4 : 2, KIND, SIGNED, DP>(data, pi.c, units, x, m0, acc);
    } else if (mr == 3) {
      panel_rows_avx2<kRows == 4 ? 3 : 2, KIND, SIGNED, DP>(data, pi.c, units, x, m0, acc);
    } else if (mr == 2) {
      panel_rows_avx2<2, KIND, SIGNED, DP>(data, pi.c, units, x, m0, acc);
    } else {
      panel_rows_avx2<1, KIND, SIGNED, DP>(data, pi.c, units, x, m0, acc);
    }
    store_rows(acc, mr, m0, pi, y, N, bias);
  }
}

template <bool DP>
FT_TARGET_AVX2 void run_panel_avx2_dp(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                                      int64_t M, float* y, int64_t N, const float* bias) {
  // Q8_0, IQ4: |q| times sign(q) * x with vpmaddubsw (its int16 pairs); vpdpbusd sums u =
  // q + 128 times x in int32, less 128 times x's sums, as the other byte codes
  if constexpr (!DP)
    if (pi.kind == kByte32 && pi.c == 128)
      return panel_avx2<kByte32, true, false>(data, pi, x, M, y, N, bias);
  with_kind(pi.kind, [&](auto kind) {
    constexpr int KIND = decltype(kind)::value;
    constexpr bool is_signed = !DP && kKinds[KIND].codes == kLut;
    panel_avx2<KIND, is_signed, DP>(data, pi, x, M, y, N, bias);
  });
}

FT_TARGET_AVX2 void run_panel_avx2(const uint8_t* data, const PanelInfo& pi, const Acts& x,
                                   int64_t M, float* y, int64_t N, const float* bias,
                                   bool avx_vnni) {
  if (avx_vnni) return run_panel_avx2_dp<true>(data, pi, x, M, y, N, bias);
  run_panel_avx2_dp<false>(data, pi, x, M, y, N, bias);
}

// quantize_block compiled for AVX2 (nearbyint becomes one vroundps, not a libm call).
FT_TARGET_AVX2 void quantize_blocks_avx2(const float* x, int B, const ActsOut& o, int64_t b0,
                                         int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) quantize_block(x, B, o, blk);
}

// The bound loops' chains: 12 independent OP (vpdpbusd, with its prefix) on registers 2..13 of
// file R, the operands in 0 and 1; and what every bound loop clobbers.
#define FT_DP_CHAIN(OP, R, N) OP " %%" R "0, %%" R "1, %%" R #N "\n\t"
#define FT_DP_CHAINS(OP, R)                                                                      \
  FT_DP_CHAIN(OP, R, 2) FT_DP_CHAIN(OP, R, 3) FT_DP_CHAIN(OP, R, 4) FT_DP_CHAIN(OP, R, 5)        \
  FT_DP_CHAIN(OP, R, 6) FT_DP_CHAIN(OP, R, 7) FT_DP_CHAIN(OP, R, 8) FT_DP_CHAIN(OP, R, 9)        \
  FT_DP_CHAIN(OP, R, 10) FT_DP_CHAIN(OP, R, 11) FT_DP_CHAIN(OP, R, 12) FT_DP_CHAIN(OP, R, 13)
#define FT_CHAIN_CLOBBERS                                                                        \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",     \
      "xmm11", "xmm12", "xmm13", "cc"

// A bound loop of 12 vpdpbusd chains: SETUP sets register 0 of file R to all ones, 1 to its
// absolute values, then `iters` rounds of FT_DP_CHAINS(OP, R), then TAIL.
#define FT_DP_BOUND_LOOP(NAME, TARGET, SETUP, OP, R, TAIL)                                     \
  TARGET __attribute__((noinline)) int32_t NAME(int64_t iters) {                                \
    if (iters <= 0) return 0;                                                                   \
    asm volatile(SETUP "vpabsb %%" R "0, %%" R "1\n\t"                                           \
                       "1:\n\t" FT_DP_CHAINS(OP, R) "dec %0\n\t"                                \
                       "jnz 1b\n\t" TAIL                                                        \
                 : "+r"(iters)                                                                  \
                 :                                                                              \
                 : FT_CHAIN_CLOBBERS);                                                          \
    return 0;                                                                                   \
  }

// The machine's int8 bound: 12 independent vpdpbusd chains on registers (64 products each).
// NOTE: written in asm: as intrinsics on an array GCC kept the 12 sums on the stack, and the
// loop measured store forwarding (~360 GOP/s a core, below what the kernel itself reached).
FT_DP_BOUND_LOOP(vnni_chains, FT_TARGET_VNNI, "vpternlogd $0xff, %%zmm0, %%zmm0, %%zmm0\n\t",
                 "vpdpbusd", "zmm", "")

// The bound with AVX-VNNI (no AVX-512): 12 independent vpdpbusd (VEX) chains on registers (32
// products each).
FT_DP_BOUND_LOOP(avx_vnni_chains, FT_TARGET_AVX2, "vpcmpeqb %%ymm0, %%ymm0, %%ymm0\n\t",
                 "%{vex%} vpdpbusd", "ymm", "vzeroupper\n\t")

// The bound without VNNI: 6 independent vpmaddubsw (32 products each) summed by vpaddw into 6
// register accumulators. No AVX2 int8 product loop does less per product: every one needs the
// multiply and at least an int16 add (the kernel also widens and scales).
FT_TARGET_AVX2 __attribute__((noinline)) int32_t avx2_int8_chains(int64_t iters) {
  if (iters <= 0) return 0;
  asm volatile(
      "vpcmpeqb %%ymm0, %%ymm0, %%ymm0\n\t"
      "vpabsb %%ymm0, %%ymm1\n\t"
      "1:\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm2\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm3\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm4\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm5\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm6\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm7\n\t"
      "vpaddw %%ymm2, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm3, %%ymm9, %%ymm9\n\t"
      "vpaddw %%ymm4, %%ymm10, %%ymm10\n\t"
      "vpaddw %%ymm5, %%ymm11, %%ymm11\n\t"
      "vpaddw %%ymm6, %%ymm12, %%ymm12\n\t"
      "vpaddw %%ymm7, %%ymm13, %%ymm13\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(iters)
      :
      : FT_CHAIN_CLOBBERS);
  return 0;
}
#undef FT_DP_BOUND_LOOP
#undef FT_DP_CHAIN
#undef FT_DP_CHAINS
#undef FT_CHAIN_CLOBBERS
#endif

bool cpu_has_avx_vnni() {
#if FT_HAS_ISA_VARIANTS
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
  return has;
#else
  return false;
#endif
}

bool cpu_has_vnni() {
#if FT_HAS_ISA_VARIANTS
  static const bool has = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

}  // namespace int8
}  // namespace freetoken
