// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// paged pool, GQA, an optional sliding window.
//
// Why: the torch path (freetoken/model/attention.py: gather the context by blocks into a dense
// copy, then SDPA) spent ~460 us per layer on 8 decode sequences of ~100 tokens here, most of it
// in the gather (a fresh tensor per layer, page faults, a second pass over the data). Decode
// attention is a few hundred KB of K/V per layer; reading them in place is memory-bound and small.
// That torch path stays the fallback and is the reference in tests/test_attention.py.
//
// Numerics: scores, softmax and the weighted sum in fp32 (as SDPA on CPU), cast to q's dtype.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops_torch.h"

namespace freetoken {
namespace {

constexpr int kLanes = 16;  // independent partial sums: the compiler vectorizes them

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) part[t] += a[j + t] * b[j + t];
  float s = 0.f;
  for (; j < n; ++j) s += a[j] * b[j];
  for (int t = 0; t < kLanes; ++t) s += part[t];
  return s;
}

inline float sum(const float* a, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) part[t] += a[j + t];
  float s = 0.f;
  for (; j < n; ++j) s += a[j];
  for (int t = 0; t < kLanes; ++t) s += part[t];
  return s;
}

// exp(x) for x <= 0 (softmax weights), written so the loop over it vectorizes (std::exp does
// not without -ffast-math, and was half the kernel's time): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-6 Taylor polynomial (error < 2e-7 relative), times 2^n from the exponent
// bits. Clamped at -87.3, where the result is ~1e-38 anyway.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float n = std::floor(x * 1.44269504089f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

struct DecodeShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  int64_t window;  // <= 0: none
};

// Sequence s, all heads: each position's K (then V) row of every kv head is one contiguous read
// (kvh * hd values), so a block is walked front to back (prefetch-friendly).
template <typename T>
inline __attribute__((always_inline)) void attend(const T* q, const T* k_pool, const T* v_pool,
                                                  const int64_t* blocks, int64_t seq_len,
                                                  int64_t s, const DecodeShape& d, T* out,
                                                  std::vector<float>& scratch) {
  const int64_t nh = d.num_heads, kvh = d.num_kv_heads, hd = d.head_dim, G = nh / kvh;
  // The query is at position seq_len - 1; the window keeps keys p > seq_len - 1 - window.
  const int64_t lo = d.window > 0 ? std::max<int64_t>(0, seq_len - d.window) : 0;
  const int64_t L = seq_len - lo, row_len = kvh * hd;
  scratch.resize(nh * hd * 2 + nh * L + row_len + nh);
  float* qf = scratch.data();   // [nh, hd], pre-scaled
  float* acc = qf + nh * hd;    // [nh, hd]
  float* sc = acc + nh * hd;    // [nh, L]
  float* row = sc + nh * L;     // [kvh * hd], one K/V row in fp32 (unused for fp32 pools)
  float* denom = row + row_len;  // [nh]
  const T* qs = q + s * nh * hd;
  for (int64_t i = 0; i < nh * hd; ++i) qf[i] = static_cast<float>(qs[i]) * d.scale;
  auto kv_row = [&](const T* pool, int64_t p) -> const float* {
    const int64_t slot = blocks[p / d.block_size] * d.block_size + p % d.block_size;
    const T* src = pool + slot * row_len;
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      load_row(src, row, row_len);
      return row;
    }
  };
  for (int64_t p = lo; p < seq_len; ++p) {
    const float* kp = kv_row(k_pool, p);
    for (int64_t head = 0; head < nh; ++head)
      sc[head * L + p - lo] = dot(qf + head * hd, kp + (head / G) * hd, hd);
  }
  for (int64_t head = 0; head < nh; ++head) {
    float* w = sc + head * L;
    const float m = *std::max_element(w, w + L);
    for (int64_t i = 0; i < L; ++i) w[i] = exp_nonpositive(w[i] - m);
    denom[head] = sum(w, L);
  }
  std::fill(acc, acc + nh * hd, 0.f);
  for (int64_t p = lo; p < seq_len; ++p) {
    const float* vp = kv_row(v_pool, p);
    for (int64_t head = 0; head < nh; ++head) {
      const float w = sc[head * L + p - lo];
      const float* v = vp + (head / G) * hd;
      float* a = acc + head * hd;
      for (int64_t j = 0; j < hd; ++j) a[j] += w * v[j];
    }
  }
  T* o = out + s * nh * hd;
  for (int64_t head = 0; head < nh; ++head)
    for (int64_t j = 0; j < hd; ++j)
      o[head * hd + j] = static_cast<T>(acc[head * hd + j] / denom[head]);
}

// NOTE: the wheel targets any x86-64 (no -march), so the float path is cloned per ISA and chosen
// at load time by the ifunc resolver; attend<float> and its helpers inline into each clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void attend_f32(const float* q, const float* k_pool, const float* v_pool, const int64_t* blocks,
                int64_t seq_len, int64_t s, const DecodeShape& d, float* out,
                std::vector<float>& scratch) {
  attend<float>(q, k_pool, v_pool, blocks, seq_len, s, d, out, scratch);
}

// fp32 pools take the ISA clones; bf16 / fp16 / fp64 the generic path.
template <typename T>
void attend_any(const T* q, const T* k_pool, const T* v_pool, const int64_t* blocks,
                int64_t seq_len, int64_t s, const DecodeShape& d, T* out,
                std::vector<float>& scratch) {
  attend<T>(q, k_pool, v_pool, blocks, seq_len, s, d, out, scratch);
}
void attend_any(const float* q, const float* k_pool, const float* v_pool, const int64_t* blocks,
                int64_t seq_len, int64_t s, const DecodeShape& d, float* out,
                std::vector<float>& scratch) {
  attend_f32(q, k_pool, v_pool, blocks, seq_len, s, d, out, scratch);
}

}  // namespace

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_table,
                                      const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [S, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2,
              "block_table must be int64 [S, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1,
              "seq_lens must be int64 [S]");
  const int64_t S = q.size(0);
  DecodeShape d{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1),
                static_cast<float>(scale), window};
  TORCH_CHECK(k_cache.size(3) == d.head_dim, "head_dim of q and the cache differ");
  TORCH_CHECK(d.num_heads % d.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.size(0) == S && seq_lens.size(0) == S, "one row per sequence");
  const auto qc = q.contiguous();
  const auto kc = k_cache.contiguous();
  const auto vc = v_cache.contiguous();
  const auto bt = block_table.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  const int64_t* bt_p = bt.data_ptr<int64_t>();
  int64_t total_keys = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = lens_p[s];
    TORCH_CHECK(n >= 1 && n <= d.max_blocks * d.block_size, "sequence ", s, " has seq_len ", n,
                " for ", d.max_blocks, " blocks of ", d.block_size);
    for (int64_t b = 0; b < (n + d.block_size - 1) / d.block_size; ++b) {
      const int64_t blk = bt_p[s * d.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "sequence ", s, " block ", b, " is ", blk,
                  ", outside the pool of ", num_blocks);
    }
    total_keys += n;
  }
  auto out = at::empty_like(qc);
  // NOTE: an OpenMP region costs a thread wake-up (~40 us under OMP_WAIT_POLICY=PASSIVE); the
  // usual decode step (a few hundred KB of K/V) is faster on the calling thread.
  const int64_t work = total_keys * d.num_heads * d.head_dim;
  const int64_t tasks = S;
  const int64_t grain = work >= (int64_t{1} << 22) ? 1 : tasks;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t s = begin; s < end; ++s)
        attend_any(qp, kp, vp, bt_p + s * d.max_blocks, lens_p[s], s, d, op, scratch);
    });
  });
  return out;
}

}  // namespace freetoken
