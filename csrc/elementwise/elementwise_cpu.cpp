// Fused elementwise ops of the Llama forward on the CPU: RMSNorm (optionally after the residual
// add), SiLU(gate) * up on the fused gate_up output, and rotate_half RoPE in place on q and k.
//
// Why: the torch code (freetoken/model/llama.py, the twins in freetoken/ops/elementwise.py) runs
// each as 3-7 ops, each a dispatch, a fresh tensor and a pass over the data; the fused kernel is
// one call and one pass (a row is re-read only from L1).
//
// Size: three ops in one file because they share the row split over the TaskPool and the
// per-ISA entry points; each op's kernel and its checks stay together.
//
// Numerics: the twin's, op by op. Every intermediate torch rounds to the tensor's dtype is rounded
// here too (bf16 round-to-nearest-even, as c10::BFloat16), everything else is fp32. What differs:
// RMSNorm's sum of squares (order, FMA) and SiLU's exp (Cephes' polynomial, <= 0.99 ulp measured
// over [-86, 88.72], vs Sleef's). RoPE is bitwise the twin's (compiled without FMA contraction).
//
// ISA: every kernel is compiled three times (AVX-512, AVX2+FMA, baseline) from one auto-vectorized
// body, and the variant follows freetoken::current_isa() (common/isa.h; set_cpu_isa), as the
// top-k kernel does. Unlike target_clones, the tests can then run all three on
// one machine. No -march: the wheel runs on any x86-64.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/isa.h"
#include "common/task_pool.h"
#include "elementwise/elementwise_cpu.h"

// NOTE: the kernel sections (everything above the torch glue) use -fno-trapping-math. Results are
// unchanged (it only lets GCC assume that fp ops raise no traps); without it GCC turns exp's
// clamp into a branch whose clamped side it folds to a constant, cannot if-convert what is left,
// and leaves SiLU scalar on AVX2 / SSE2. Inline functions defined outside such a section (std::,
// torch headers) are not inlined into it, hence the builtins below and the glue outside it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

namespace freetoken {
namespace {


using bf16_t = uint16_t;  // the bits of a c10::BFloat16

// ---------------------------------------------------------------------------------------------
// conversions (branch-free, so the loops around them vectorize)

FT_INLINE float to_float(float v) { return v; }
FT_INLINE float to_float(bf16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
FT_INLINE T from_float(float f);
template <>
FT_INLINE float from_float<float>(float f) {
  return f;
}
// c10::round_to_nearest_even: NaN -> 0x7FC0, else add 0x7FFF plus the kept lsb, truncate.
template <>
FT_INLINE bf16_t from_float<bf16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? bf16_t{0x7FC0} : static_cast<bf16_t>(r);
}

// What torch stores for an op whose fp32 result is f: identity for fp32, the bf16 value for bf16
// (to_float(from_float<bf16_t>(f)), without narrowing to 16 bits and back).
template <typename T>
FT_INLINE float round_to(float f);
template <>
FT_INLINE float round_to<float>(float f) {
  return f;
}
template <>
FT_INLINE float round_to<bf16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = f != f ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = w * round_x(x * rsqrt(mean(x^2) + eps)), optionally x := x + residual first.

struct NormArgs {
  const void* x;
  int64_t x_stride;
  void* residual;  // nullable; [T, H], receives x + residual
  int64_t r_stride;
  const void* w;  // [H]
  void* out;      // [T, H], contiguous
  int64_t H;
  float eps;
};

constexpr int kLanes = 32;  // independent partial sums: two AVX-512 / four AVX2 accumulators

template <typename T>
FT_INLINE float sum_squares(const T* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) {
      const float v = to_float(x[j + t]);
      part[t] += v * v;
    }
  for (int t = 0; j < n; ++j, ++t) {
    const float v = to_float(x[j]);
    part[t] += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2)  // a tree, not a chain of kLanes dependent adds
    for (int t = 0; t < w; ++t) part[t] += part[t + w];
  return part[0];
}

template <typename X, typename W, typename O, bool kResidual>
struct RmsNorm {
  using Args = NormArgs;
  static FT_INLINE void run(const NormArgs& a, int64_t begin, int64_t end) {
    const W* w = static_cast<const W*>(a.w);
    const int64_t H = a.H;
    for (int64_t t = begin; t < end; ++t) {
      const X* x = static_cast<const X*>(a.x) + t * a.x_stride;
      O* o = static_cast<O*>(a.out) + t * H;
      if constexpr (kResidual) {
        X* r = static_cast<X*>(a.residual) + t * a.r_stride;
        for (int64_t j = 0; j < H; ++j) r[j] = from_float<X>(to_float(x[j]) + to_float(r[j]));
        x = r;  // the row is in L1 now
      }
      // torch: mean = sum / H, then + eps, rsqrt = 1 / sqrt (its vectorized and scalar forms).
      // __builtin_sqrtf: std::sqrt would not be inlined here (see the NOTE at the top).
      const float ms = sum_squares(x, H) / static_cast<float>(H);
      const float inv = 1.f / __builtin_sqrtf(ms + a.eps);
      for (int64_t j = 0; j < H; ++j)
        o[j] = from_float<O>(to_float(w[j]) * round_to<X>(to_float(x[j]) * inv));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// SiLU(gate) * up: out[t, j] = round(round(g / (1 + exp(-g))) * u), g = in[t, j], u = in[t, I + j]

struct SiluArgs {
  const void* in;  // [T, 2I]
  int64_t in_stride;
  void* out;  // [T, I], contiguous
  int64_t I;
};

// exp(x) to ~1 ulp for SiLU's 1 + exp(-g), vectorizable (std::exp is not without -ffast-math):
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, n added to its exponent.
// From 88.72284 (where expf rounds to inf) inf; below -86 exp(-86) = 4e-38 instead of smaller,
// so that every result is a normal float (1 + either is 1). NaN: no meaningful value (SiLU's
// numerator carries the NaN).
FT_INLINE float exp_for_silu(float x) {
  const bool overflow = x >= 88.72283935546875f;  // the least float whose expf is inf
  x = x < 88.8f ? x : 88.8f;  // keeps x * log2e far below 2^22 (the rounding trick's range)
  x = x > -86.f ? x : -86.f;
  const float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float nm = x * 1.44269504088896341f + kMagic;
  const float n = nm - kMagic;
  uint32_t nbits;
  std::memcpy(&nbits, &nm, sizeof nbits);
  const uint32_t ni = nbits - 0x4B400000u;  // n (two's complement), in [-124, 128]
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;  // in [0.7, 1.42]: exponent 126 or 127 (126 when n = 128)
  uint32_t pbits;
  std::memcpy(&pbits, &p, sizeof pbits);
  pbits += ni << 23;  // times 2^n: the exponent stays in [2, 254]
  float e;
  std::memcpy(&e, &pbits, sizeof e);
  return overflow ? __builtin_inff() : e;
}

template <typename T>
struct SiluMul {
  using Args = SiluArgs;
  static FT_INLINE void run(const SiluArgs& a, int64_t begin, int64_t end) {
    const int64_t I = a.I;
    for (int64_t t = begin; t < end; ++t) {
      const T* g = static_cast<const T*>(a.in) + t * a.in_stride;
      const T* u = g + I;
      T* o = static_cast<T*>(a.out) + t * I;
      for (int64_t j = 0; j < I; ++j) {
        const float gv = to_float(g[j]);
        const float act = round_to<T>(gv / (1.f + exp_for_silu(-gv)));  // F.silu's result
        o[j] = from_float<T>(act * to_float(u[j]));
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The ISA variants of a kernel K (a struct with `static void run(const Args&, begin, end)`).

template <typename K>
struct Variants {
  using Args = typename K::Args;
  FT_TARGET_AVX512 static void avx512(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
  FT_TARGET_AVX2 static void avx2(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
  static void base(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
};

}  // namespace
}  // namespace freetoken

// ---------------------------------------------------------------------------------------------
// RoPE, in its own section: torch rounds q * cos and rotate_half(q) * sin before adding them, so
// FMA contraction (-ffp-contract=fast, on for the build) would change fp32 results. NOTE:
// contraction is decided per function after inlining, so the functions that matter are the ISA
// wrappers below, not the inlined body.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

namespace freetoken {
namespace {

struct RopeArgs {
  void* q;  // [T, nh, hd]: row stride q_stride, head stride hd
  int64_t q_stride, nh;
  void* k;  // [T, kvh, hd]
  int64_t k_stride, kvh;
  const void* cos;  // [T, hd]: row stride c_stride
  int64_t c_stride;
  const void* sin;
  int64_t s_stride;
  int64_t hd;
};

// x[:half], x[half:] <- x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, each product rounded like torch.
template <typename T>
FT_INLINE void rope_heads(T* x, int64_t heads, const T* c, const T* s, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h, x += hd)
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
      const float lo = round_to<T>(x1 * to_float(c[j])) + round_to<T>(-x2 * to_float(s[j]));
      const float hi =
          round_to<T>(x2 * to_float(c[j + half])) + round_to<T>(x1 * to_float(s[j + half]));
      x[j] = from_float<T>(lo);
      x[j + half] = from_float<T>(hi);
    }
}

template <typename T>
struct Rope {
  using Args = RopeArgs;
  static FT_INLINE void run(const RopeArgs& a, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = static_cast<const T*>(a.cos) + t * a.c_stride;
      const T* s = static_cast<const T*>(a.sin) + t * a.s_stride;
      rope_heads(static_cast<T*>(a.q) + t * a.q_stride, a.nh, c, s, a.hd);
      rope_heads(static_cast<T*>(a.k) + t * a.k_stride, a.kvh, c, s, a.hd);
    }
  }
};

// Variants<Rope<T>>, but defined in this section: a function (a template's too) is compiled with
// the options in force where it is defined, so Variants' members would contract.
template <typename T>
struct RopeVariants {
  using Args = RopeArgs;
  using K = Rope<T>;
  FT_TARGET_AVX512 static void avx512(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
  FT_TARGET_AVX2 static void avx2(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
  static void base(const Args& a, int64_t b, int64_t e) { K::run(a, b, e); }
};

}  // namespace
}  // namespace freetoken

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options  // fp-contract
#pragma GCC pop_options  // no-trapping-math
#elif defined(__clang__)
#pragma STDC FP_CONTRACT ON
#endif

// ---------------------------------------------------------------------------------------------
// torch glue: checks, outputs, dispatch

namespace freetoken {
namespace {

// NOTE: these ops run on the kernels' TaskPool (common/task_pool.h), whose helpers poll between
// the calls of a forward: a split costs ~2 us there against ~40 us for waking OpenMP's workers
// under OMP_WAIT_POLICY=PASSIVE. Below this many input elements an op stays on the caller (a
// decode step's rows); above it the rows go in equal ranges to every thread (a classify step's
// 224 rows: its norms and RoPE took ~250 us a layer on one thread).
constexpr int64_t kSplitElements = int64_t{1} << 15;
constexpr int64_t kTasksPerThread = 2;

// V: a struct with static avx512 / avx2 / base (const Args&, begin, end) over rows.
template <typename V>
auto isa_variant() -> void (*)(const typename V::Args&, int64_t, int64_t) {
  switch (current_isa()) {  // cpuid-checked; follows set_cpu_isa
    case Isa::kAvx512:
      return &V::avx512;
    case Isa::kAvx2:
      return &V::avx2;
    default:
      return &V::base;
  }
}

template <typename V>
void run_rows(const typename V::Args& a, int64_t rows, int64_t row_elements) {
  const auto fn = isa_variant<V>();
  const int nthreads = rows * row_elements < kSplitElements ? 1 : at::get_num_threads();
  const int64_t n = std::min<int64_t>(rows, nthreads * kTasksPerThread);
  if (n <= 1) return fn(a, 0, rows);
  TaskPool::get().run(n, nthreads, [&](int64_t t) { fn(a, rows * t / n, rows * (t + 1) / n); });
}


bool is_fp32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// A [T, H] tensor whose rows are contiguous (any row stride).
void check_rows(const char* fn, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, fn, ": ", name, " must be 2-D [T, H], got ", t.dim(), "-D");
  TORCH_CHECK(is_fp32_or_bf16(t), fn, ": ", name, " must be float32 or bfloat16, got ",
              t.scalar_type());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, fn, ": ", name,
              " must have contiguous rows (stride(1) == 1), got strides ", t.strides());
}

at::Tensor norm_impl(const char* fn, const at::Tensor& x, const at::Tensor* residual,
                     const at::Tensor& weight, double eps) {
  check_rows(fn, "x", x);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.size(0) == H, fn,
              ": weight must be a CPU tensor of shape [", H, "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, fn,
              ": weight must be float32 or x's dtype (", x.scalar_type(), "), got ",
              weight.scalar_type());
  TORCH_CHECK(weight.stride(0) == 1 || H <= 1, fn, ": weight must be contiguous");
  if (residual != nullptr) {
    check_rows(fn, "residual", *residual);
    TORCH_CHECK(residual->sizes() == x.sizes(), fn, ": residual must have x's shape ",
                x.sizes(), ", got ", residual->sizes());
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), fn, ": residual must have x's dtype (",
                x.scalar_type(), "), got ", residual->scalar_type());
  }
  // torch's promotion of weight * normalized: bf16 x with an fp32 weight gives fp32
  auto out = at::empty({T, H}, x.options().dtype(weight.scalar_type()));
  NormArgs a{x.data_ptr(),
             x.stride(0),
             residual ? residual->data_ptr() : nullptr,
             residual ? residual->stride(0) : 0,
             weight.data_ptr(),
             out.data_ptr(),
             H,
             static_cast<float>(eps)};
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool w_bf16 = weight.scalar_type() == at::kBFloat16;
  if (residual != nullptr) {
    if (!x_bf16)
      run_rows<Variants<RmsNorm<float, float, float, true>>>(a, T, H);
    else if (w_bf16)
      run_rows<Variants<RmsNorm<bf16_t, bf16_t, bf16_t, true>>>(a, T, H);
    else
      run_rows<Variants<RmsNorm<bf16_t, float, float, true>>>(a, T, H);
  } else {
    if (!x_bf16)
      run_rows<Variants<RmsNorm<float, float, float, false>>>(a, T, H);
    else if (w_bf16)
      run_rows<Variants<RmsNorm<bf16_t, bf16_t, bf16_t, false>>>(a, T, H);
    else
      run_rows<Variants<RmsNorm<bf16_t, float, float, false>>>(a, T, H);
  }
  return out;
}

// q or k: [T, heads, hd], each token's heads contiguous (views into a fused qkv are fine).
void check_heads(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "rope_: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3, "rope_: ", name, " must be 3-D [T, heads, head_dim], got ", t.dim(),
              "-D");
  TORCH_CHECK(t.stride(2) == 1 && (t.stride(1) == t.size(2) || t.size(1) <= 1), "rope_: ", name,
              " must have stride(2) == 1 and stride(1) == head_dim, got strides ", t.strides());
}

// cos or sin: [T, hd] or [T, 1, hd] -> its row stride.
int64_t check_table(const char* name, const at::Tensor& t, const at::Tensor& q) {
  const int64_t T = q.size(0), hd = q.size(2);
  TORCH_CHECK(t.device().is_cpu(), "rope_: ", name, " must be a CPU tensor");
  const bool shape_ok = (t.dim() == 2 && t.size(0) == T && t.size(1) == hd) ||
                        (t.dim() == 3 && t.size(0) == T && t.size(1) == 1 && t.size(2) == hd);
  TORCH_CHECK(shape_ok, "rope_: ", name, " must be [", T, ", ", hd, "] or [", T, ", 1, ", hd,
              "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "rope_: ", name, " must have q's dtype (",
              q.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1 || hd <= 1, "rope_: ", name, " must have contiguous rows");
  return t.stride(0);
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_impl("rms_norm", x, nullptr, weight, eps);
}

at::Tensor add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, double eps) {
  return norm_impl("add_rms_norm", x, &residual, weight, eps);
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up, int64_t intermediate_size) {
  check_rows("silu_mul", "gate_up", gate_up);
  const int64_t T = gate_up.size(0), I = intermediate_size;
  TORCH_CHECK(I >= 0 && gate_up.size(1) == 2 * I, "silu_mul: gate_up must be [T, 2 * ", I,
              "], got ", gate_up.sizes());
  auto out = at::empty({T, I}, gate_up.options());
  SiluArgs a{gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), I};
  if (gate_up.scalar_type() == at::kBFloat16)
    run_rows<Variants<SiluMul<bf16_t>>>(a, T, 2 * I);
  else
    run_rows<Variants<SiluMul<float>>>(a, T, 2 * I);
  return out;
}

void silu_mul_rows_fp32(const float* gate_up, int64_t stride, int64_t I, int64_t t0, int64_t t1,
                        float* out) {
  const SiluArgs a{gate_up + t0 * stride, stride, out, I};
  isa_variant<Variants<SiluMul<float>>>()(a, 0, t1 - t0);
}

void rope_cpu_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
               const at::Tensor& sin) {
  check_heads("q", q);
  check_heads("k", k);
  TORCH_CHECK(is_fp32_or_bf16(q), "rope_: q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rope_: k must have q's dtype (",
              q.scalar_type(), "), got ", k.scalar_type());
  const int64_t T = q.size(0), hd = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == hd, "rope_: k must be [", T, ", kv_heads, ", hd,
              "], got ", k.sizes());
  TORCH_CHECK(hd % 2 == 0, "rope_: head_dim must be even, got ", hd);
  const int64_t c_stride = check_table("cos", cos, q);
  const int64_t s_stride = check_table("sin", sin, q);
  RopeArgs a{q.data_ptr(), q.stride(0),   q.size(1),     k.data_ptr(), k.stride(0),
             k.size(1),    cos.data_ptr(), c_stride,     sin.data_ptr(), s_stride,
             hd};
  const int64_t per_token = (q.size(1) + k.size(1)) * hd;
  if (q.scalar_type() == at::kBFloat16)
    run_rows<RopeVariants<bf16_t>>(a, T, per_token);
  else
    run_rows<RopeVariants<float>>(a, T, per_token);
}

}  // namespace freetoken
