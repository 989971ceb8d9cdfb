// freetoken._C: the fused mask / logit-bias / log-softmax / top-k kernel.
//
// This header is torch-free: the CPU ISA kernels (topk_kernels.cpp) and the CUDA sources
// (cuda/*.cu) include it; the torch glue lives in topk_cpu.cpp and cuda/ops_cuda_glue.cpp.
//
// Contract (see docs/architecture.md, "Kernel"): per row r of logits [B, V],
//   x(t) = logit(t) + bias(t)                  bias summed over duplicate ids
//   set  = allowed ids of r (duplicates once), or all of [0, V) when r's range is empty
//   lse  = log sum_{t in set} exp x(t)
//   top-k of set by (x desc, id asc), logprob = x - lse, padded with id -1 / -inf.
//   full = log sum_{t in [0, V)} exp x(t), on request: the unmasked lse, so that lse - full is
//          the log of the mass the whole distribution puts on the set (NaN when a logit
//          outside the set is NaN, +inf when one is +inf: those are no error there).
#pragma once

#include <cstdint>

namespace freetoken {

constexpr int kMaxK = 64;
// Dense rows are walked in blocks of kBlock elements (L1-resident); chunk bounds are multiples.
constexpr int64_t kBlock = 1024;

enum : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum : int32_t { kFlagNaN = 1, kFlagPosInf = 2 };

// The result of one task: a slice of one row (or a whole gathered row).
struct Partial {
  float m;          // max x over the slice (-inf when empty)
  int32_t cnt;      // number of valid entries in vals/ids (<= k)
  double s;         // sum exp(x - m)
  int32_t flags;    // kFlag*
  float fm;         // the same three over every element of the slice, unmasked (the full
  double fs;        // lse's part); valid when the slice had no mask or DenseArgs::full was set
  int32_t fflags;
  float vals[kMaxK];  // sorted by (value desc, id asc)
  int32_t ids[kMaxK];
};

struct DenseArgs {
  const void* row;           // element 0 of the row
  int32_t dtype;             // kF32 / kBF16 / kF16
  int64_t lo, hi;            // the slice [lo, hi), lo a multiple of kBlock
  int32_t k;
  const float* bias;         // nullable; absolute-id dense bias, read only in flagged blocks
  const uint8_t* bias_blk;   // nullable; bias_blk[id / kBlock] != 0 when that block has bias
  const uint64_t* bits;      // nullable; absolute-id allowed bitmask
  bool full;                 // with bits: also sum the unmasked elements (Partial::fm/fs)
};

using DenseFn = void (*)(const DenseArgs&, Partial*);
// vals/ids: n values in any id order, padded with -inf to a multiple of 16.
using ValuesFn = void (*)(const float* vals, const int32_t* ids, int64_t n, int32_t k, Partial*);

struct IsaKernels {
  const char* name;
  DenseFn dense;
  ValuesFn values;
};

// One per ISA variant (topk_kernels.cpp; avx512 and avx2 only where FT_HAS_ISA_VARIANTS).
namespace isa_avx512 { IsaKernels kernels(); }
namespace isa_avx2 { IsaKernels kernels(); }
namespace isa_base { IsaKernels kernels(); }

// Insert (v, id) into P's sorted top-k list; shared by every ISA and the merge.
inline bool topk_better(float a, int32_t ia, float b, int32_t ib) {
  return a > b || (a == b && ia < ib);
}
inline void topk_insert(Partial* P, int32_t k, float v, int32_t id) {
  int32_t n = P->cnt;
  if (n == k) {
    if (!topk_better(v, id, P->vals[k - 1], P->ids[k - 1])) return;
    n = k - 1;
  } else {
    P->cnt = n + 1;
  }
  int32_t j = n;
  while (j > 0 && topk_better(v, id, P->vals[j - 1], P->ids[j - 1])) {
    P->vals[j] = P->vals[j - 1];
    P->ids[j] = P->ids[j - 1];
    --j;
  }
  P->vals[j] = v;
  P->ids[j] = id;
}

}  // namespace freetoken
