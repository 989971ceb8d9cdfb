// CUDA topk_logprobs: the same contract as the CPU kernel (topk/topk.h), over raw pointers.
//
//   prep   (only with allowed lists) one thread per list entry: sets the row's allowed bit with
//          atomicOr; the entry whose atomicOr set it first owns the id, later copies are
//          duplicates (dup[j] = 1) and count once.
//   chunk  grid (B, chunks): a block takes kChunk elements of a dense row (no mask, or a set of
//          >= V/16 ids read through the bitmask) or kChunk entries of a short allowed list
//          (gathered), adds the bias, and writes the slice's max, sum exp(x - max), flags and
//          its top-k (radix select on order-preserving 32-bit keys, ties by id).
//   merge  one block per row: combines the slices' (max, sum) in fp64 and ranks every slice
//          candidate by binary search in the other slices' sorted lists; rank < k is written.
// With out_full, a row with a set also gets its unmasked lse: a dense slice sums its elements
// before the mask (same shared-memory values), and the block of a gathered row's chunk c sums
// dense slice c of the row; the merge combines those (max, sum) pairs like the masked ones.
// Errors (NaN / +inf in the set, an all -inf set) are reported per row in out_status.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "topk/topk.h"
#include "topk_cuda.h"

namespace freetoken {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 4096;               // elements (or list entries) per block
constexpr int kPer = kChunk / kThreads;    // 16 per thread, element i = tid + j * kThreads
constexpr int kSegs = kChunk / 32;         // warp-contiguous 32-element segments
constexpr int kBiasTab = 2048;             // smem hash of a gathered row's bias (power of two)
constexpr int kBiasMax = kBiasTab / 2;     // longer bias lists are searched linearly
constexpr int kFlagAllNegInf = 4;

struct ChunkOut {
  float m;
  float s;
  int32_t cnt;
  int32_t flags;
  float fm;        // the unmasked (max, sum exp(x - max), flags) of the slice (out_full only)
  float fs;
  int32_t fflags;
  float vals[kMaxK];  // sorted by (value desc, id asc)
  int32_t ids[kMaxK];
};

__host__ __device__ inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint32_t key_of(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);  // -0 -> +0: equal floats, equal keys
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf -> 0x007fffff; 0 = not a member
}
__device__ __forceinline__ float float_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool better(float a, int32_t ia, float b, int32_t ib) {
  return a > b || (a == b && ia < ib);
}

template <typename T> __device__ __forceinline__ float load_as_float(const T* p, int64_t i);
template <> __device__ __forceinline__ float load_as_float<float>(const float* p, int64_t i) {
  return __ldg(p + i);
}
template <> __device__ __forceinline__ float load_as_float<__nv_bfloat16>(const __nv_bfloat16* p,
                                                                          int64_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float load_as_float<__half>(const __half* p, int64_t i) {
  return __half2float(p[i]);
}

__device__ __forceinline__ int row_of(const int32_t* offsets, int64_t B, int64_t j) {
  int lo = 0, hi = (int)B;  // the last row r with offsets[r] <= j
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= j) lo = mid; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ bool gathered(int64_t n, int64_t V) { return n > 0 && n * 16 < V; }

__global__ void prep_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ ids,
                            int64_t n, int64_t B, int64_t words, uint32_t* bits, uint8_t* dup) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int r = row_of(offsets, B, j);
  const int32_t id = ids[j];
  const uint32_t bit = 1u << (id & 31);
  const uint32_t old = atomicOr(bits + r * words + (id >> 5), bit);
  dup[j] = (old & bit) ? 1 : 0;
}

template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* sh, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  v = sh[0];
  for (int i = 1; i < kWarps; ++i) v = op(v, sh[i]);
  return v;
}
struct MaxOp { __device__ float operator()(float a, float b) const { return a > b ? a : b; } };
struct SumOp { __device__ float operator()(float a, float b) const { return a + b; } };

// sval[i] = x(lo + i) (logit + summed bias) for i < n, a dense slice of a row; bsum: kChunk
// floats of scratch. Every thread of the block must call it.
template <typename T>
__device__ void load_dense(const TopkArgs& a, const T* row, int64_t lo, int n, int32_t bb,
                           int nb, float* sval, float* bsum) {
  const int tid = threadIdx.x;
  for (int i = tid; i < n; i += kThreads) sval[i] = load_as_float(row, lo + i);
  if (nb > 0) {
    // biases are summed first and added once, x + (b1 + b2), exactly as on the CPU
    for (int i = tid; i < kChunk; i += kThreads) bsum[i] = 0.f;
    __syncthreads();
    for (int j = tid; j < nb; j += kThreads) {
      const int64_t id = a.bias_ids[bb + j];
      if (id >= lo && id < lo + n) atomicAdd(bsum + (id - lo), a.bias_values[bb + j]);
    }
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) sval[i] = sval[i] + bsum[i];
  }
}

// The unmasked (max, sum exp(x - max), flags) of sval[0, n) into out->fm / fs / fflags: NaN and
// +inf are flagged, not errors (they make the full lse NaN / +inf). Every thread must call it.
__device__ void full_stats(const float* sval, int n, float* red, int* fflags_sh, ChunkOut* out) {
  const int tid = threadIdx.x;
  const float inf = __int_as_float(0x7f800000);
  if (tid == 0) *fflags_sh = 0;
  __syncthreads();
  float m = -inf;
  int flags = 0;
  for (int i = tid; i < n; i += kThreads) {
    const float v = sval[i];
    if (v != v) {
      flags |= kFlagNaN;
    } else {
      if (v == inf) flags |= kFlagPosInf;
      m = v > m ? v : m;
    }
  }
  if (flags) atomicOr(fflags_sh, flags);
  m = block_reduce(m, red, MaxOp());
  float s = 0.f;
  if (m > -inf && m < inf)
    for (int i = tid; i < n; i += kThreads)
      if (sval[i] == sval[i]) s += expf(sval[i] - m);
  s = block_reduce(s, red, SumOp());
  if (tid == 0) {
    out->fm = m;
    out->fs = s;
    out->fflags = *fflags_sh;
  }
  __syncthreads();
}

struct SelectShared {
  int hist[256];
  int seg_pre[kSegs];
  uint32_t sel_key[kMaxK];
  int32_t sel_id[kMaxK];
  int n_sel, pick_bin, pick_want;
};

// The top kk (<= kMaxK) of kChunk keys in shared memory (key 0 = absent), by (key desc, id asc),
// handed to write(rank, value, id) in rank order by the threads tid < kk. ids == nullptr: the
// id of slot i is base + i (so index order is id order). Radix select, 8 bits a pass: T = the
// kk-th largest key; all keys above T are taken, and the `want` lowest ids among keys == T.
// Every thread of the block must call it.
template <typename Write>
__device__ void select_topk(const uint32_t* skey, const int32_t* ids, int64_t base, int kk,
                            SelectShared& sh, Write write) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) sh.n_sel = 0;
  if (kk <= 0) return;
  uint32_t prefix = 0, pmask = 0;
  int want = kk;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    for (int j = 0; j < kPer; ++j) {
      const uint32_t key = skey[tid + j * kThreads];
      const bool in = key != 0 && (key & pmask) == prefix;
      const int bin = in ? (int)((key >> shift) & 255u) : -1 - lane;  // unique when not in
      const unsigned peers = __match_any_sync(0xffffffffu, bin);       // warp-aggregated add
      if (in && lane == __ffs(peers) - 1) atomicAdd(sh.hist + bin, __popc(peers));
    }
    __syncthreads();
    if (warp == 0) {  // lane l owns bins 255-8l .. 248-8l, highest first
      int cnt[8], tot = 0;
      for (int q = 0; q < 8; ++q) { cnt[q] = sh.hist[255 - 8 * lane - q]; tot += cnt[q]; }
      int incl = tot;
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      const int excl = incl - tot;
      if (excl < want && incl >= want) {
        int acc = excl;
        for (int q = 0; q < 8; ++q) {
          if (acc + cnt[q] >= want) { sh.pick_bin = 255 - 8 * lane - q; sh.pick_want = want - acc; break; }
          acc += cnt[q];
        }
      }
    }
    __syncthreads();
    prefix |= (uint32_t)sh.pick_bin << shift;
    pmask |= 255u << shift;
    want = sh.pick_want;
    __syncthreads();
  }
  const uint32_t T = prefix;

  if (!ids) {  // ranks among keys == T by index: warp ballots + a scan over 32-slot segments
    for (int j = 0; j < kPer; ++j) {
      const unsigned eq = __ballot_sync(0xffffffffu, skey[tid + j * kThreads] == T);
      if (lane == 0) sh.seg_pre[j * kWarps + warp] = __popc(eq);
    }
    __syncthreads();
    if (warp == 0) {
      constexpr int kPerLane = kSegs / 32;
      int v[kPerLane], tot = 0;
      for (int q = 0; q < kPerLane; ++q) { v[q] = sh.seg_pre[lane * kPerLane + q]; tot += v[q]; }
      int incl = tot;
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      int run = incl - tot;
      for (int q = 0; q < kPerLane; ++q) { sh.seg_pre[lane * kPerLane + q] = run; run += v[q]; }
    }
    __syncthreads();
  }
  for (int j = 0; j < kPer; ++j) {
    const int i = tid + j * kThreads;
    const uint32_t key = skey[i];
    const bool eq = key == T;
    const unsigned eqm = __ballot_sync(0xffffffffu, eq);
    if (key == 0 || key < T) continue;
    const int32_t id = ids ? ids[i] : (int32_t)(base + i);
    bool take = key > T;
    if (eq) {
      int rank = 0;
      if (!ids) {
        rank = sh.seg_pre[j * kWarps + warp] + __popc(eqm & ((1u << lane) - 1u));
      } else {  // any id order (gathered lists, merged slices): count smaller ids among equals
        for (int q = 0; q < kChunk; ++q) rank += (skey[q] == T && ids[q] < id);
      }
      take = rank < want;
    }
    if (take) {
      const int slot = atomicAdd(&sh.n_sel, 1);
      sh.sel_key[slot] = key;
      sh.sel_id[slot] = id;
    }
  }
  __syncthreads();
  if (tid < kk) {
    const float v = float_of(sh.sel_key[tid]);
    const int32_t id = sh.sel_id[tid];
    int rank = 0;
    for (int q = 0; q < kk; ++q) rank += better(float_of(sh.sel_key[q]), sh.sel_id[q], v, id);
    write(rank, v, id);
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
chunk_kernel(TopkArgs a, const uint32_t* __restrict__ bits, const uint8_t* __restrict__ dup,
             int64_t words, int nchunks, ChunkOut* __restrict__ outs) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sval = reinterpret_cast<float*>(smem_raw);            // [kChunk], then keys in place
  uint32_t* skey = reinterpret_cast<uint32_t*>(smem_raw);
  int32_t* sid = reinterpret_cast<int32_t*>(sval + kChunk);    // [kChunk] gathered ids
  int32_t* btab_id = sid + kChunk;                             // [kBiasTab]
  float* btab_val = reinterpret_cast<float*>(btab_id + kBiasTab);
  __shared__ float red[kWarps];
  __shared__ SelectShared sel;
  __shared__ int flags_sh, fflags_sh;

  const int tid = threadIdx.x;
  const int64_t r = blockIdx.x;  // rows in x (up to 2^31 - 1), slices in y
  const int c = blockIdx.y;
  ChunkOut* out = outs + r * nchunks + c;
  const int64_t V = a.V;
  const int32_t ab = a.allowed_offsets ? a.allowed_offsets[r] : 0;
  const int32_t ae = a.allowed_offsets ? a.allowed_offsets[r + 1] : 0;
  const bool gather = gathered(ae - ab, V);
  const bool masked = ae > ab && !gather;
  const bool want_full = a.out_full != nullptr && ae > ab;
  const int64_t lo = (int64_t)c * kChunk;
  const int64_t len = gather ? (int64_t)(ae - ab) : V;
  const T* row = reinterpret_cast<const T*>(a.logits) + r * V;
  const int32_t bb = a.bias_offsets ? a.bias_offsets[r] : 0;
  const int32_t be = a.bias_offsets ? a.bias_offsets[r + 1] : 0;
  const int nb = be - bb;
  if (gather && want_full) {  // dense slice c of the row (lo < V: nchunks covers V), unmasked
    const int dn = V - lo < kChunk ? (int)(V - lo) : kChunk;
    load_dense(a, row, lo, dn, bb, nb, sval, reinterpret_cast<float*>(sid));
    full_stats(sval, dn, red, &fflags_sh, out);
  }
  if (lo >= len) {  // a gathered row needs fewer blocks than a dense one
    if (tid == 0) { out->m = -__int_as_float(0x7f800000); out->s = 0.f; out->cnt = 0; out->flags = 0; }
    return;
  }
  const int n = len - lo < kChunk ? (int)(len - lo) : kChunk;
  const uint32_t* rbits = bits ? bits + r * words : nullptr;
  if (tid == 0) flags_sh = 0;

  // 1. values (and ids) into shared memory; non-members get NaN for now, then key 0
  if (gather) {
    for (int i = tid; i < kBiasTab; i += kThreads) { btab_id[i] = -1; btab_val[i] = 0.f; }
    for (int i = tid; i < n; i += kThreads) {
      const int64_t j = ab + lo + i;
      const int32_t id = a.allowed_ids[j];
      sid[i] = dup[j] ? -1 : id;
      sval[i] = load_as_float(row, id);
    }
    __syncthreads();
    if (nb > 0 && nb <= kBiasMax) {
      for (int j = tid; j < nb; j += kThreads) {
        const int32_t id = a.bias_ids[bb + j];
        uint32_t h = ((uint32_t)id * 2654435761u) & (kBiasTab - 1);
        while (true) {
          const int32_t old = atomicCAS(btab_id + h, -1, id);
          if (old == -1 || old == id) break;
          h = (h + 1) & (kBiasTab - 1);
        }
        atomicAdd(btab_val + h, a.bias_values[bb + j]);
      }
      __syncthreads();
    }
    if (nb > 0) {
      for (int i = tid; i < n; i += kThreads) {
        const int32_t id = sid[i];
        if (id < 0) continue;
        float b = 0.f;
        if (nb <= kBiasMax) {
          uint32_t h = ((uint32_t)id * 2654435761u) & (kBiasTab - 1);
          while (btab_id[h] != -1) {
            if (btab_id[h] == id) { b = btab_val[h]; break; }
            h = (h + 1) & (kBiasTab - 1);
          }
        } else {
          for (int j = 0; j < nb; ++j)
            if (a.bias_ids[bb + j] == id) b += a.bias_values[bb + j];
        }
        sval[i] = sval[i] + b;
      }
    }
  } else {
    load_dense(a, row, lo, n, bb, nb, sval, reinterpret_cast<float*>(sid));
  }
  __syncthreads();
  if (want_full && !gather) full_stats(sval, n, red, &fflags_sh, out);  // before the mask

  // 2. keys in place, the slice's max and member count, NaN / +inf flags
  float m = -__int_as_float(0x7f800000);
  int members = 0, flags = 0;
  for (int j = 0; j < kPer; ++j) {
    const int i = tid + j * kThreads;
    uint32_t key = 0;
    if (i < n) {
      const int64_t id = gather ? (int64_t)sid[i] : lo + i;
      bool member = id >= 0;
      if (member && masked) member = (rbits[id >> 5] >> (id & 31)) & 1u;
      const float v = sval[i];
      if (member) {
        if (v != v) { flags |= kFlagNaN; }
        else {
          if (v == __int_as_float(0x7f800000)) flags |= kFlagPosInf;
          key = key_of(v);
          m = v > m ? v : m;
          ++members;
        }
      }
    }
    skey[i] = key;
  }
  if (flags) atomicOr(&flags_sh, flags);
  m = block_reduce(m, red, MaxOp());
  members = (int)block_reduce((float)members, red, SumOp());  // exact: <= 4096
  __syncthreads();
  flags = flags_sh;

  // 3. sum exp(x - m)
  float s = 0.f;
  if (m > -__int_as_float(0x7f800000) && m < __int_as_float(0x7f800000)) {
    for (int j = 0; j < kPer; ++j) {
      const int i = tid + j * kThreads;
      const uint32_t key = skey[i];
      if (key) s += expf(float_of(key) - m);
    }
  }
  s = block_reduce(s, red, SumOp());

  // 4. the slice's top-kk, sorted
  const int kk = min(a.k, members);
  select_topk(skey, gather ? sid : nullptr, lo, kk, sel, [&](int rank, float v, int32_t id) {
    out->vals[rank] = v;
    out->ids[rank] = id;
  });
  if (tid == 0) {
    out->m = m;
    out->s = s;
    out->cnt = kk;
    out->flags = flags;
  }
}

// One block per row: (max, sum) of the slices in fp64, then the top k of their candidates
// (nchunks * k <= kChunk slots, slot c * k + j = slice c's j-th) by the same select.
__global__ void __launch_bounds__(kThreads)
merge_kernel(TopkArgs a, int nchunks, const ChunkOut* __restrict__ outs) {
  __shared__ uint32_t mkey[kChunk];
  __shared__ int32_t mid[kChunk];
  __shared__ SelectShared sel;
  __shared__ double dred[kWarps];
  __shared__ float fred[kWarps];
  __shared__ int flags_sh, total_sh, fflags_sh;
  const int tid = threadIdx.x;
  const int64_t r = blockIdx.x;
  const ChunkOut* parts = outs + r * nchunks;
  const float ninf = -__int_as_float(0x7f800000);
  const int k = a.k;
  if (tid == 0) { flags_sh = 0; total_sh = 0; fflags_sh = 0; }
  for (int i = tid; i < kChunk; i += kThreads) {
    uint32_t key = 0;
    int32_t id = 0;
    if (k > 0 && i < nchunks * k) {
      const ChunkOut& p = parts[i / k];
      const int j = i % k;
      if (j < p.cnt) { key = key_of(p.vals[j]); id = p.ids[j]; }
    }
    mkey[i] = key;
    mid[i] = id;
  }
  __syncthreads();
  float m = ninf;
  int flags = 0, total = 0;
  for (int c = tid; c < nchunks; c += kThreads) {
    m = fmaxf(m, parts[c].m);
    flags |= parts[c].flags;
    total += parts[c].cnt;
  }
  if (flags) atomicOr(&flags_sh, flags);
  if (total) atomicAdd(&total_sh, total);
  m = block_reduce(m, fred, MaxOp());
  double s = 0.0;
  if (m > ninf)
    for (int c = tid; c < nchunks; c += kThreads)
      if (parts[c].m > ninf) s += (double)parts[c].s * exp((double)parts[c].m - (double)m);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((tid & 31) == 0) dred[tid >> 5] = s;
  __syncthreads();
  s = 0.0;
  for (int i = 0; i < kWarps; ++i) s += dred[i];
  flags = flags_sh;
  if (m == ninf) flags |= kFlagAllNegInf;
  if (m == __int_as_float(0x7f800000)) flags |= kFlagPosInf;
  const double lse = (double)m + log(s);
  if (tid == 0) {
    a.out_status[r] = flags;
    a.out_lse[r] = flags ? __int_as_float(0x7fc00000) : (float)lse;
  }
  if (a.out_full) {
    // a row without a set: full = lse; else the slices' unmasked pairs, combined as above
    const bool has_set = a.allowed_offsets && a.allowed_offsets[r + 1] > a.allowed_offsets[r];
    float full = flags ? __int_as_float(0x7fc00000) : (float)lse;
    if (has_set) {  // uniform over the block: the reductions' barriers are safe
      float fm = ninf;
      int ff = 0;
      for (int c = tid; c < nchunks; c += kThreads) {
        fm = fmaxf(fm, parts[c].fm);
        ff |= parts[c].fflags;
      }
      if (ff) atomicOr(&fflags_sh, ff);
      fm = block_reduce(fm, fred, MaxOp());
      double fs = 0.0;
      if (fm > ninf && fm < -ninf)
        for (int c = tid; c < nchunks; c += kThreads)
          if (parts[c].fm > ninf)
            fs += (double)parts[c].fs * exp((double)parts[c].fm - (double)fm);
      for (int o = 16; o > 0; o >>= 1) fs += __shfl_xor_sync(0xffffffffu, fs, o);
      if ((tid & 31) == 0) dred[tid >> 5] = fs;
      __syncthreads();
      fs = 0.0;
      for (int i = 0; i < kWarps; ++i) fs += dred[i];
      ff = fflags_sh;
      full = (ff & kFlagNaN)                       ? __int_as_float(0x7fc00000)
             : (ff & kFlagPosInf) || fm == -ninf ? -ninf
                                                 : (float)((double)fm + log(fs));
    }
    if (tid == 0) a.out_full[r] = full;
  }
  const int kk = min(k, total_sh);
  select_topk(mkey, mid, 0, kk, sel, [&](int rank, float v, int32_t id) {
    a.out_ids[r * k + rank] = id;
    a.out_logprobs[r * k + rank] = (float)((double)v - lse);
  });
  for (int j = kk + tid; j < k; j += kThreads) {
    a.out_ids[r * k + j] = -1;
    a.out_logprobs[r * k + j] = ninf;
  }
}

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

constexpr size_t kSmemBytes =
    kChunk * sizeof(float) + kChunk * sizeof(int32_t) + kBiasTab * (sizeof(int32_t) + sizeof(float));

template <typename T>
cudaError_t launch_chunks(const TopkArgs& a, const uint32_t* bits, const uint8_t* dup,
                          int64_t words, int nchunks, ChunkOut* outs, cudaStream_t stream) {
  static bool configured = false;  // benign race: the attribute is idempotent
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(chunk_kernel<T>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)kSmemBytes);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  dim3 grid((unsigned)a.B, nchunks);
  chunk_kernel<T><<<grid, kThreads, kSmemBytes, stream>>>(a, bits, dup, words, nchunks, outs);
  return cudaGetLastError();
}

}  // namespace

size_t topk_workspace_bytes(int64_t B, int64_t V, int64_t n_allowed) {
  const int64_t nchunks = div_up(V, kChunk);
  const int64_t words = div_up(V, 32);
  return align_up(B * nchunks * sizeof(ChunkOut)) + align_up(B * words * sizeof(uint32_t)) +
         align_up(n_allowed > 0 ? n_allowed : 1);
}

int64_t topk_max_vocab(int32_t k) { return k > 0 ? (int64_t)(kChunk / k) * kChunk : INT32_MAX; }

cudaError_t topk_launch(const TopkArgs& a, cudaStream_t stream) {
  if (a.B == 0) return cudaSuccess;
  const int nchunks = (int)div_up(a.V, kChunk);
  if ((int64_t)nchunks * a.k > kChunk) return cudaErrorInvalidValue;  // see topk_max_vocab
  const int64_t words = div_up(a.V, 32);
  char* ws = static_cast<char*>(a.workspace);
  ChunkOut* outs = reinterpret_cast<ChunkOut*>(ws);
  ws += align_up(a.B * nchunks * sizeof(ChunkOut));
  uint32_t* bits = nullptr;
  uint8_t* dup = nullptr;
  if (a.allowed_offsets && a.n_allowed > 0) {
    bits = reinterpret_cast<uint32_t*>(ws);
    ws += align_up(a.B * words * sizeof(uint32_t));
    dup = reinterpret_cast<uint8_t*>(ws);
    cudaError_t e = cudaMemsetAsync(bits, 0, a.B * words * sizeof(uint32_t), stream);
    if (e != cudaSuccess) return e;
    const int64_t blocks = div_up(a.n_allowed, kThreads);
    prep_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(a.allowed_offsets, a.allowed_ids,
                                                           a.n_allowed, a.B, words, bits, dup);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  TopkArgs b = a;
  if (!bits) b.allowed_offsets = nullptr;  // no entries at all: no mask on any row
  cudaError_t e;
  switch (a.dtype) {
    case kF32: e = launch_chunks<float>(b, bits, dup, words, nchunks, outs, stream); break;
    case kBF16: e = launch_chunks<__nv_bfloat16>(b, bits, dup, words, nchunks, outs, stream); break;
    case kF16: e = launch_chunks<__half>(b, bits, dup, words, nchunks, outs, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  merge_kernel<<<(unsigned)a.B, kThreads, 0, stream>>>(b, nchunks, outs);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace freetoken
