// The dense one-pass kernel, compiled once per ISA (topk_kernels.cpp).
//
// Not a normal header: topk_kernels.cpp includes <immintrin.h> and topk.h, then defines FT_ISA_NS,
// FT_ISA_NAME, FT_ISA_LEVEL (2 = AVX-512, 1 = AVX2+FMA+F16C, 0 = baseline x86-64 / any CPU) and
// FT_ISA_FN (the variant's FT_TARGET_* attribute, common/isa.h, carried by every function here,
// the intrinsics need it) and includes this file, once per ISA. Everything here has internal
// linkage (an anonymous namespace) so no ISA-specific inline function can be merged across ISAs.
//
// Per block of kBlock elements (L1-resident): convert/bias/mask into a buffer when needed, take
// the block max, insert top-k candidates only when the block max beats the current k-th value
// (rare after the first blocks), rescale the running sum when the max grows, then add
// exp(x - max) with a vectorised exp. One exp per element; sums are fp32 per block, fp64 across.

namespace freetoken {
namespace FT_ISA_NS {
namespace {

// One vector: 16 lanes for AVX-512, 8 for AVX2, 4 for the baseline (SSE2 on x86-64).
#if FT_ISA_LEVEL >= 2
constexpr int L = 16;
#elif FT_ISA_LEVEL == 1
constexpr int L = 8;
#else
constexpr int L = 4;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef uint16_t vh __attribute__((vector_size(2 * L)));

constexpr float kNegInf = -__builtin_inff();

// Every function of the body carries the variant's target (FT_ISA_FN).
#undef FT_KFN
#define FT_KFN inline __attribute__((always_inline)) FT_ISA_FN

FT_KFN vf splat(float x) { return vf{} + x; }
FT_KFN vf loadu(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof(v)); return v; }
FT_KFN void storeu(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }

FT_KFN float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < L; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
FT_KFN float hsum(vf v) {
  float t[L];
  for (int i = 0; i < L; ++i) t[i] = v[i];
  for (int w = L / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// sum_i exp(src[i] - m) over nv values (a multiple of L), as 2^((x - m) * log2e):
// t = (x - m) * log2e (not fma(x, log2e, -m*log2e): that is off by ulp(m*log2e) even at x = m,
// 1e-5 relative for logits near 100) clamped below at -126 (so -inf and masked lanes add ~1e-38, never
// NaN, and no denormals), n = round(t), 2^(t-n) by Cephes' exp2f polynomial (~1 ulp on
// [-0.5, 0.5]), scaled by 2^n. NaN propagates into the sum. Two accumulators for latency.
constexpr float kLog2e = 1.44269504088896341f;
#define FT_EXP2_POLY(F, FMA, SET)                                                 \
  FMA(FMA(FMA(FMA(FMA(FMA(SET(1.535336188319500e-4f), F, SET(1.339887440266574e-3f)), F, \
                      SET(9.618437357674640e-3f)), F, SET(5.550332471162809e-2f)), F,   \
              SET(2.402264791363012e-1f)), F, SET(6.931472028550421e-1f)), F, SET(1.0f))

// exp(x - m) per lane (the method above).
FT_KFN vf exp_shifted(vf x, vf m) {
#if FT_ISA_LEVEL >= 2
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-126.0f),  // max(lo, NaN) = NaN
                                 _mm512_mul_ps(_mm512_sub_ps((__m512)x, (__m512)m),
                                               _mm512_set1_ps(kLog2e)));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  const __m512 p = FT_EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps);
  return (vf)_mm512_scalef_ps(p, n);
#elif FT_ISA_LEVEL == 1
  const __m256 t = _mm256_max_ps(_mm256_set1_ps(-126.0f),
                                 _mm256_mul_ps(_mm256_sub_ps((__m256)x, (__m256)m),
                                               _mm256_set1_ps(kLog2e)));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  const __m256 p = FT_EXP2_POLY(f, _mm256_fmadd_ps, _mm256_set1_ps);
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return (vf)_mm256_mul_ps(p, _mm256_castsi256_ps(e));
#else
  vf t = (x - m) * kLog2e;
  t = (t < -126.0f) ? splat(-126.0f) : t;  // NaN stays NaN
  const vf n = (t + 12582912.0f) - 12582912.0f;
  const vf f = t - n;
#define FT_VFMA(a, b, d) ((a) * (b) + (d))
  const vf p = FT_EXP2_POLY(f, FT_VFMA, splat);
#undef FT_VFMA
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)e;
#endif
}

FT_KFN vf vmax(vf a, vf b) { return b > a ? b : a; }  // a NaN b is ignored

// One pass over nv values (a multiple of L) read by load(i): s = sum exp(x - ref), bm = max x.
template <typename Load>
FT_KFN void sum_and_max(const Load& load, int64_t nv, float ref, float& s, float& bm) {
  const vf mv = splat(ref);
  vf s0 = splat(0.0f), s1 = s0, m0 = splat(kNegInf), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * L <= nv; i += 2 * L) {
    const vf x0 = load(i), x1 = load(i + L);
    m0 = vmax(m0, x0);
    m1 = vmax(m1, x1);
    s0 += exp_shifted(x0, mv);
    s1 += exp_shifted(x1, mv);
  }
  for (; i < nv; i += L) {
    const vf x0 = load(i);
    m0 = vmax(m0, x0);
    s0 += exp_shifted(x0, mv);
  }
  s = hsum(s0 + s1);
  bm = hmax(vmax(m0, m1));
}
template <typename Load>
FT_KFN float max_only(const Load& load, int64_t nv) {
  vf m0 = splat(kNegInf), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * L <= nv; i += 2 * L) {
    m0 = vmax(m0, load(i));
    m1 = vmax(m1, load(i + L));
  }
  for (; i < nv; i += L) m0 = vmax(m0, load(i));
  return hmax(vmax(m0, m1));
}
template <typename Load>
FT_KFN float sum_only(const Load& load, int64_t nv, float ref) {
  const vf mv = splat(ref);
  vf s0 = splat(0.0f), s1 = s0;
  int64_t i = 0;
  for (; i + 2 * L <= nv; i += 2 * L) {
    s0 += exp_shifted(load(i), mv);
    s1 += exp_shifted(load(i + L), mv);
  }
  for (; i < nv; i += L) s0 += exp_shifted(load(i), mv);
  return hsum(s0 + s1);
}

// Lanes of v strictly greater than thr (ge: or equal), as an L-bit mask.
FT_KFN uint32_t cmp_mask(vf v, float thr, bool ge) {
#if FT_ISA_LEVEL >= 2
  __m512 a = (__m512)v, b = _mm512_set1_ps(thr);
  return ge ? (uint32_t)_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)
            : (uint32_t)_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ);
#elif FT_ISA_LEVEL == 1
  __m256 a = (__m256)v, b = _mm256_set1_ps(thr);
  return ge ? (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ))
            : (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ));
#else
  uint32_t m = 0;
  for (int i = 0; i < L; ++i) m |= (uint32_t)(ge ? v[i] >= thr : v[i] > thr) << i;
  return m;
#endif
}

FT_KFN float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / nan
  } else if (em >= 0x0400u) {
    bits = sign | ((em + ((127 - 15) << 10)) << 13);   // normal
  } else {
    float f = (float)em * 5.9604644775390625e-8f;       // subnormal: em * 2^-24
    uint32_t fb;
    __builtin_memcpy(&fb, &f, 4);
    bits = sign | fb;
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}

// L elements of the row starting at element i, as fp32.
FT_KFN vf loadv(const void* row, int32_t dtype, int64_t i) {
  if (dtype == kF32) return loadu((const float*)row + i);
  const uint16_t* p = (const uint16_t*)row + i;
  if (dtype == kBF16) {
    vh h;
    __builtin_memcpy(&h, p, sizeof(h));
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
  }
#if FT_ISA_LEVEL >= 2
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif FT_ISA_LEVEL == 1
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int j = 0; j < L; ++j) v[j] = half_to_float(p[j]);
  return v;
#endif
}

FT_KFN float load1(const void* row, int32_t dtype, int64_t i) {
  if (dtype == kF32) return ((const float*)row)[i];
  uint16_t h = ((const uint16_t*)row)[i];
  if (dtype == kBF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  return half_to_float(h);
}

FT_KFN bool better(float a, int32_t ia, float b, int32_t ib) {
  return a > b || (a == b && ia < ib);
}
FT_KFN void insert(Partial* P, int32_t k, float v, int32_t id) {
  int32_t n = P->cnt;
  if (n == k) {
    if (!better(v, id, P->vals[k - 1], P->ids[k - 1])) return;
    n = k - 1;
  } else {
    P->cnt = n + 1;
  }
  int32_t j = n;
  while (j > 0 && better(v, id, P->vals[j - 1], P->ids[j - 1])) {
    P->vals[j] = P->vals[j - 1];
    P->ids[j] = P->ids[j - 1];
    --j;
  }
  P->vals[j] = v;
  P->ids[j] = id;
}

// Running state of one slice.
struct Acc {
  float m = kNegInf;
  double s = 0.0;
  int32_t flags = 0;
};

// One block of nv values (a multiple of L, padded with -inf) of which n are real, read by
// load(i) -- or from src when src != nullptr (then load(i) == loadu(src + i)).
// ids == nullptr: the id of value i is base + i (increasing, so an equal value never displaces);
// otherwise ids[i], in any order (so equal values must be compared by id: ge = true).
// allowed == nullptr: every real value is in the set; otherwise a per-element membership test
// is needed only while the top-k list is not yet full (disallowed values are -inf).
//
// The running max acc.m is the reference of the block's exp pass, which also takes the block
// max: one pass. Only when the block's max exceeds the reference by > 64 (fp32 could overflow)
// is the sum redone against the block max; with no reference yet, max first, then sum.
template <typename Load>
FT_KFN void block(const Load& load, const float* src, float* buf, int64_t n, int64_t nv,
                     int64_t base, const int32_t* ids, const uint64_t* allowed, int32_t k,
                     Partial* P, Acc& acc) {
  float s = 0.0f, bm, ref;
  if (acc.m == __builtin_inff()) {  // already an error
    acc.flags |= kFlagPosInf;
    return;
  }
  if (acc.m != kNegInf) {
    ref = acc.m;
    sum_and_max(load, nv, ref, s, bm);
    if (bm > ref + 64.0f) {
      ref = bm;
      s = sum_only(load, nv, ref);
    }
  } else {
    bm = max_only(load, nv);
    ref = bm;
    if (bm != kNegInf && bm != __builtin_inff()) s = sum_only(load, nv, ref);
  }

  if (k > 0) {
    const bool fill = P->cnt < k;
    if (fill || bm > P->vals[k - 1] || (ids && bm == P->vals[k - 1])) {
      if (!src) {
        for (int64_t j = 0; j < nv; j += L) storeu(buf + j, load(j));
        src = buf;
      }
      int64_t j0 = 0;  // values before j0 are already offered
      if (fill) {
        for (; j0 < n && P->cnt < k; ++j0) {
          const int64_t id = ids ? ids[j0] : base + j0;
          if (allowed && !((allowed[id >> 6] >> (id & 63)) & 1)) continue;
          insert(P, k, src[j0], (int32_t)id);
        }
      }
      if (j0 < n && (bm > P->vals[k - 1] || (ids && bm == P->vals[k - 1]))) {
        const bool ge = ids != nullptr;
        for (int64_t j = j0 & ~int64_t(L - 1); j < nv; j += L) {
          uint32_t mask = cmp_mask(loadu(src + j), P->vals[k - 1], ge);
          while (mask) {
            const int l = __builtin_ctz(mask);
            mask &= mask - 1;
            const int64_t jj = j + l;
            if (jj >= n) break;
            if (jj < j0) continue;
            insert(P, k, src[jj], (int32_t)(ids ? ids[jj] : base + jj));
          }
        }
      }
    }
  }

  if (bm == __builtin_inff()) {  // an error: stop summing (the sum would be NaN)
    acc.flags |= kFlagPosInf;
    acc.m = bm;
    return;
  }
  if (bm == kNegInf && acc.m == kNegInf) {  // nothing but -inf so far: NaN hides from the max
    if (!src) {
      for (int64_t j = 0; j < nv; j += L) storeu(buf + j, load(j));
      src = buf;
    }
    for (int64_t j = 0; j < n; ++j)
      if (src[j] != src[j]) acc.flags |= kFlagNaN;
    return;
  }
  const float M = bm > acc.m ? bm : acc.m;
  const double prev = acc.m == kNegInf ? 0.0 : acc.s * __builtin_exp((double)acc.m - (double)M);
  acc.s = prev + (double)s * __builtin_exp((double)ref - (double)M);
  acc.m = M;
}

// full: the slice's unmasked state when it differs from acc (a mask and DenseArgs::full).
FT_KFN void finish(Partial* P, const Acc& acc, const Acc* full) {
  P->m = acc.m;
  P->s = acc.s;
  P->flags = acc.flags | (acc.s != acc.s ? kFlagNaN : 0);
  const Acc& f = full ? *full : acc;
  P->fm = f.m;
  P->fs = f.s;
  P->fflags = f.flags | (f.s != f.s ? kFlagNaN : 0);
}

// load(i) for values read straight from memory (a row, buf).
struct LoadFrom {
  const float* p;
  FT_KFN vf operator()(int64_t i) const { return loadu(p + i); }
};

FT_ISA_FN void dense_impl(const DenseArgs& a, Partial* P) {
  alignas(64) float buf[kBlock];
  P->cnt = 0;
  Acc acc, full;  // full: every element, before the mask (only with a.full and a.bits)
  const bool with_full = a.full && a.bits;
  const LoadFrom from_buf{buf};
  for (int64_t b0 = a.lo; b0 < a.hi; b0 += kBlock) {
    const int64_t n = a.hi - b0 < kBlock ? a.hi - b0 : kBlock;
    const int64_t nv = (n + 15) & ~int64_t(15);
    const bool has_bias = a.bias_blk && a.bias_blk[b0 / kBlock];
    if (a.dtype == kF32 && !has_bias && !a.bits && n == nv) {  // straight from the row
      const float* src = (const float*)a.row + b0;
      block(LoadFrom{src}, src, buf, n, nv, b0, nullptr, nullptr, a.k, P, acc);
      continue;
    }
    // NOTE: bf16/fp16 are converted into buf first: converting inside the exp pass measured
    // slower (the conversion then competes with the exp for the same ports).
    const int64_t nfull = n & ~int64_t(L - 1);
    for (int64_t j = 0; j < nfull; j += L) storeu(buf + j, loadv(a.row, a.dtype, b0 + j));
    for (int64_t j = nfull; j < nv; ++j) buf[j] = j < n ? load1(a.row, a.dtype, b0 + j) : kNegInf;
    if (has_bias) {
      const float* bp = a.bias + b0;
      for (int64_t j = 0; j < n; ++j) buf[j] = buf[j] + bp[j];
    }
    // the unmasked sum reads the same L1-resident block, before the mask overwrites it
    if (with_full) block(from_buf, buf, buf, n, nv, b0, nullptr, nullptr, 0, P, full);
    if (a.bits) {
      vi lane;
      for (int j = 0; j < L; ++j) lane[j] = 1 << j;
      const vf ninf = splat(kNegInf);
      for (int64_t j = 0; j < nv; j += L) {
        const int64_t id = b0 + j;  // a multiple of L
        const int32_t w = (int32_t)((a.bits[id >> 6] >> (id & 63)) & ((1u << L) - 1));
        const vi sel = (lane & w) != 0;
        storeu(buf + j, sel ? loadu(buf + j) : ninf);
      }
    }
    block(from_buf, buf, buf, n, nv, b0, nullptr, a.bits, a.k, P, acc);
  }
  finish(P, acc, with_full ? &full : nullptr);
}

FT_ISA_FN void values_impl(const float* vals, const int32_t* ids, int64_t n, int32_t k,
                           Partial* P) {
  alignas(64) float buf[kBlock];
  P->cnt = 0;
  Acc acc;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t nb = n - b0 < kBlock ? n - b0 : kBlock;
    const int64_t nv = (nb + 15) & ~int64_t(15);
    const float* src = vals + b0;
    block(LoadFrom{src}, src, buf, nb, nv, 0, ids + b0, nullptr, k, P, acc);
  }
  const Acc none;  // a gathered subset says nothing of the whole row (dense tasks sum that)
  finish(P, acc, &none);
}

}  // namespace

IsaKernels kernels() { return IsaKernels{FT_ISA_NAME, &dense_impl, &values_impl}; }

}  // namespace FT_ISA_NS
}  // namespace freetoken
