// The AVX-512 pieces that the int8 mode's VNNI loop (int8_kernels.cpp) and AMX loop
// (int8_amx.cpp) share: a group's or a superblock's fp32 step after its integer sums, in the
// order of int8_linear.cpp's module comment. Both loops call these, so their bits are the same
// by construction.
#pragma once

#if FT_HAS_ISA_VARIANTS
#include <immintrin.h>

#include <cstring>

#include "linear/int8_kernels.h"

#define FT_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace freetoken {
namespace int8 {

// An fp32 product kept apart from the add that follows (the files build with -ffp-contract=fast).
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

// Groups 2 p and 2 p + 1 of a unit's 8-bit numbers (16 outputs each, at g) as int16 pairs, lane
// o = (g[2 p][o], g[2 p + 1][o]): vpdpwssd's operand.
template <bool SIGNED>
FT_TARGET_VNNI FT_INLINE __m512i group_pairs(const uint8_t* g, int p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 * p));
  const __m512i w = SIGNED ? _mm512_maskz_cvtepi8_epi16(0xFFFFFFFF, v)
                           : _mm512_maskz_cvtepu8_epi16(0xFFFFFFFF, v);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                              17, 1, 16, 0);
  return _mm512_maskz_permutexvar_epi16(0xFFFFFFFF, interleave, w);
}

// acc += pairs . (the two int16 at p, broadcast): one vpdpwssd.
FT_TARGET_VNNI FT_INLINE __m512i dot2w(__m512i acc, __m512i pairs, const int16_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(pairs), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// A 6-bit group's 16 codes an output as four vectors of bytes, vector s holding codes
// 4 s .. 4 s + 3 of each output: the 4-bit plane (vectors t, t + 2) and the 2-bit plane (bits
// 2 s, 2 s + 1).
FT_TARGET_VNNI FT_INLINE void six_bit_steps(const uint8_t* codes, __m512i (&v)[4]) {
  const __m512i low4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
  const __m512i plane = _mm512_loadu_si512(codes + 128);
  for (int t = 0; t < 2; ++t) {
    const __m512i n = _mm512_loadu_si512(codes + 64 * t);
    v[t] = _mm512_and_si512(n, low4);
    v[t + 2] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low4);
  }
  v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(plane, 4), hi2));
  v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(plane, 2), hi2));
  v[2] = _mm512_or_si512(v[2], _mm512_and_si512(plane, hi2));
  v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_srli_epi16(plane, 2), hi2));
}

// IQ4's indices (kLut) become their codes by vpshufb from kIq4Codes in every 128-bit lane.
FT_TARGET_VNNI FT_INLINE __m512i iq4_codes512() {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Codes)));
}

// A 2-bit or 3-bit group's 16 codes an output (CODES kTwo / kThree) as four vectors of bytes,
// vector s holding codes 4 s .. 4 s + 3 of each output: bits 2 s, 2 s + 1 of the 2-bit plane,
// and kThree's third bits, whose 32 bytes widen to a vector whose byte 4 o + j holds them at
// bits 0..3 (byte 2 o + (j >> 1) to 16-bit lane, its high nibble to the lane's high byte).
template <int CODES>
FT_TARGET_VNNI FT_INLINE void low_bit_steps(const uint8_t* codes, __m512i (&v)[4]) {
  const __m512i low2 = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
  const __m512i plane = _mm512_loadu_si512(codes);
  v[0] = _mm512_and_si512(plane, low2);
  v[1] = _mm512_and_si512(_mm512_srli_epi16(plane, 2), low2);
  v[2] = _mm512_and_si512(_mm512_srli_epi16(plane, 4), low2);
  v[3] = _mm512_and_si512(_mm512_srli_epi16(plane, 6), low2);
  if constexpr (CODES == kThree) {
    const __m512i w = _mm512_maskz_cvtepu8_epi16(
        0xFFFFFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64)));
    const __m512i h = _mm512_or_si512(w, _mm512_slli_epi16(w, 4));
    v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(h, 2), bit2));
    v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(h, 1), bit2));
    v[2] = _mm512_or_si512(v[2], _mm512_and_si512(h, bit2));
    v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_srli_epi16(h, 1), bit2));
  }
}

// A 32-value group's fp32 step for rows [m0, m0 + MR): P[m] = the group's codes . x's 32 at
// group g32 (without the offset c, subtracted here; OFFSET_IN_P: with it, the AMX loop's signed
// codes), codes = the group's bytes in the panel.
//   acc = acc + float(P - c * S) * (a * d)        acc = acc + b * (d * float(S))  (a min)
template <int MR, int KIND, bool OFFSET_IN_P = false>
FT_TARGET_VNNI FT_INLINE void group_step(const uint8_t* codes, int32_t c, const Acts& x,
                                         int64_t m0, int64_t g32, const __m512i (&P)[MR],
                                         __m512 (&acc)[MR]) {
  const int64_t ld32 = x.K / kXBlock;
  const __m512 a = halfs16(codes + code_bytes(KIND));
  __m512 b = _mm512_setzero_ps();
  if constexpr (kKinds[KIND].scales == kHalfMin) b = halfs16(codes + code_bytes(KIND) + 32);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const int64_t xb = (m0 + m) * ld32 + g32;
    __m512i p = P[m];
    if constexpr (!has_min(KIND) && !OFFSET_IN_P)
      p = _mm512_sub_epi32(p, _mm512_set1_epi32(c * x.s32[xb]));
    const __m512 t = no_contract512(_mm512_mul_ps(a, _mm512_set1_ps(x.d[xb])));
    acc[m] = _mm512_add_ps(
        acc[m], no_contract512(_mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, p), t)));
    if constexpr (has_min(KIND))
      acc[m] = _mm512_add_ps(acc[m],
                             no_contract512(_mm512_mul_ps(b, _mm512_set1_ps(x.xs32[xb]))));
  }
}

// I[m] += group j's integer sums P[m] times its integer scales (a K-quant unit at unit; Q6_K's
// scales are int8).
template <int MR, int KIND>
FT_TARGET_VNNI FT_INLINE void add_scaled(const uint8_t* unit, int j, const __m512i (&P)[MR],
                                         __m512i (&I)[MR]) {
  const __m128i s8 =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + sc_offset(KIND) + 16 * j));
  const __m512i scv = kKinds[KIND].scales == kK4 ? _mm512_maskz_cvtepu8_epi32(0xFFFF, s8)
                                                 : _mm512_maskz_cvtepi8_epi32(0xFFFF, s8);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) I[m] = _mm512_add_epi32(I[m], _mm512_mullo_epi32(P[m], scv));
}

// Where a superblock's step reads x's rows m0.. (row m): its sums (over its groups: 8 sums of 32
// or 16 of 16) and its d. From Acts' row-major arrays (RowsX), or from Acts::sd
// (PackedRowsX: rows kSdRowBytes apart, constants the addressing takes as displacements: the
// AMX loop's 224-row Q4_K 8192 x 2048 0.95x the time of RowsX, 2048 x 8192 0.75x / 0.84x (two
// threads / one), whose rows' sums lay 512 bytes apart).
struct RowsX {
  const int16_t* s;
  int64_t s_ld;
  const float* d;
  int64_t d_ld;
  RowsX(const Acts& x, int64_t m0, int64_t u, bool sums_of_32) {
    const int64_t ld16 = x.K / 16, ld32 = x.K / kXBlock;
    s = sums_of_32 ? x.s32 + m0 * ld32 + u * 8 : x.s16 + m0 * ld16 + u * 16;
    s_ld = sums_of_32 ? ld32 : ld16;
    d = x.d + m0 * ld32 + u * 8;
    d_ld = ld32;
  }
  const int16_t* sums(int m) const { return s + m * s_ld; }
  float scale(int m) const { return d[m * d_ld]; }
};
struct PackedRowsX {
  const uint8_t* row0;  // row m0's 32 bytes in Acts::sd
  const int16_t* sums(int m) const {
    return reinterpret_cast<const int16_t*>(row0 + m * kSdRowBytes);
  }
  float scale(int m) const {
    float d;
    std::memcpy(&d, row0 + m * kSdRowBytes + 16, sizeof d);
    return d;
  }
};

// A K-quant superblock's fp32 step for MR rows (x's at rows, see RowsX), superblock unit, after
// its groups' integer sum I[m] = sum_g sc[g] * (codes . x) (no offset): the second integer sum
// (Q4_K / Q5_K / Q2_K the mins times x's group sums; Q6_K / Q3_K / IQ4_XS c times its scales
// times them, the offset), then acc_out [MR][16] (L1) += the superblock's fp32 terms.
// OFFSET_IN_I: an offset kind's I[m] already holds sum_g sc[g] * ((codes - c) . x) (the AMX
// loop's scaled codes), the same int32 as I - S.
// NOTE: x's rows through locals (rows), not Acts& x: a vector store may alias x's fields, so GCC
// read them again for every row (AMX 224-row Q4_K 8192 x 2048: 0.91-0.97x the time without).
template <int MR, int KIND, bool OFFSET_IN_I = false, typename Rows>
FT_TARGET_VNNI FT_INLINE void superblock_step(const uint8_t* unit, int32_t c, const Rows& rows,
                                              __m512i (&I)[MR], float* acc_out) {
  constexpr int PER = 256 / kKinds[KIND].group;
  constexpr bool k4 = kKinds[KIND].scales == kK4;
  const uint8_t* sc = unit + sc_offset(KIND);
  __m512i S[MR];
  for (int m = 0; m < MR; ++m) S[m] = _mm512_setzero_si512();
  constexpr bool second_sum = k4 || !OFFSET_IN_I;
#pragma GCC unroll 16
  for (int p = 0; second_sum && p < PER / 2; ++p) {
    __m512i pairs = group_pairs<!k4>(k4 ? unit + min_offset(KIND) : sc, p);
    // Q6_K: c * sc in the pairs (32 x [-128, 127] fits int16), once a superblock, not a
    // vpmulld (two uops) a row.
    if constexpr (!k4) pairs = _mm512_mullo_epi16(pairs, _mm512_set1_epi16(int16_t(c)));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) S[m] = dot2w(S[m], pairs, rows.sums(m) + 2 * p);
  }
  const __m512 d = halfs16(unit);
  const __m512 nmin =
      k4 ? _mm512_xor_ps(halfs16(unit + 32), _mm512_set1_ps(-0.f)) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512 dx = _mm512_set1_ps(rows.scale(m));
    if constexpr (!k4 && !OFFSET_IN_I) I[m] = _mm512_sub_epi32(I[m], S[m]);
    const __m512 t = no_contract512(_mm512_mul_ps(d, dx));
    __m512 acc = _mm512_add_ps(
        _mm512_loadu_ps(acc_out + m * kPanel),
        no_contract512(_mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, I[m]), t)));
    if constexpr (k4) {
      const __m512 t2 = no_contract512(_mm512_mul_ps(nmin, dx));
      acc = _mm512_add_ps(
          acc, no_contract512(_mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, S[m]), t2)));
    }
    _mm512_storeu_ps(acc_out + m * kPanel, acc);
  }
}

}  // namespace int8
}  // namespace freetoken

#endif
