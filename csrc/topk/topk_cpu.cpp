// CPU topk_logprobs: argument checks, per-row planning (gather / dense bitmask / dense, plus the
// unmasked sum when asked for), the parallel loop over (row, chunk) tasks, the merge; the dense
// kernel's ISA variant follows current_isa() (common/isa.h).
#include <ATen/Parallel.h>  // at::get_num_threads: the pool follows torch.set_num_threads
#include <torch/extension.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/isa.h"
#include "common/task_pool.h"
#include "topk/topk.h"
#include "topk/topk_torch.h"

namespace freetoken {
namespace {

IsaKernels kernels_for(Isa isa) {
  switch (isa) {
#if FT_HAS_ISA_VARIANTS
    case Isa::kAvx512: return isa_avx512::kernels();
    case Isa::kAvx2: return isa_avx2::kernels();
#endif
    default: return isa_base::kernels();
  }
}

// Per-thread scratch, all indexed by absolute token id and kept all-zero between tasks (each
// task clears exactly what it set, so the cost is O(set + bias), never O(V)).
struct Scratch {
  std::vector<float> bias;        // [V]
  std::vector<uint8_t> bias_blk;  // [V / kBlock + 1]
  std::vector<uint64_t> bits;     // [V / 64 + 1]
  std::vector<float> gvals;       // gathered values, padded to 16 with -inf
  std::vector<int32_t> gids;

  void ensure(int64_t V) {
    if ((int64_t)bias.size() < V) {
      bias.assign(V, 0.0f);
      bias_blk.assign(V / kBlock + 1, 0);
      bits.assign(V / 64 + 1, 0);
      gvals.resize(V + 16);
      gids.resize(V + 16);
    }
  }
};
thread_local Scratch tls;


enum class Mode { kDense, kMasked, kGather };

struct Task {
  int64_t row, lo, hi;
  Mode mode;
  bool full;  // kDense: only the unmasked sum of a gathered row (k = 0, no top-k);
              // kMasked: the unmasked sum as well, in the same pass
};

struct Compact {
  const int32_t* offsets = nullptr;
  const int32_t* ids = nullptr;
  const float* values = nullptr;
  int32_t begin(int64_t r) const { return offsets ? offsets[r] : 0; }
  int32_t end(int64_t r) const { return offsets ? offsets[r + 1] : 0; }
};

inline float load_one(const void* row, int32_t dtype, int64_t i) {
  if (dtype == kF32) return ((const float*)row)[i];
  const uint16_t h = ((const uint16_t*)row)[i];
  if (dtype == kBF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

void run_task(const IsaKernels& isa, const Task& t, const char* base, int64_t row_bytes,
              int32_t dtype, int64_t V, int32_t k, const Compact& allowed, const Compact& bias,
              Partial* P) {
  Scratch& s = tls;
  s.ensure(V);
  const void* row = base + t.row * row_bytes;
  const int32_t bb = bias.begin(t.row), be = bias.end(t.row);
  const int32_t ab = allowed.begin(t.row), ae = allowed.end(t.row);

  if (t.mode == Mode::kGather) {
    for (int32_t j = bb; j < be; ++j) s.bias[bias.ids[j]] += bias.values[j];
    const bool has_bias = be > bb;
    const int esz = dtype == kF32 ? 4 : 2;
    int64_t n = 0;
    for (int32_t j = ab; j < ae; ++j) {
      if (j + 16 < ae) __builtin_prefetch((const char*)row + (int64_t)allowed.ids[j + 16] * esz);
      const int32_t id = allowed.ids[j];
      uint64_t& w = s.bits[id >> 6];
      const uint64_t bit = uint64_t(1) << (id & 63);
      if (w & bit) continue;  // a duplicate counts once
      w |= bit;
      const float v = load_one(row, dtype, id);
      s.gvals[n] = has_bias ? v + s.bias[id] : v;
      s.gids[n] = id;
      ++n;
    }
    for (int64_t j = n; j < ((n + 15) & ~int64_t(15)); ++j) {
      s.gvals[j] = -std::numeric_limits<float>::infinity();
      s.gids[j] = std::numeric_limits<int32_t>::max();
    }
    for (int32_t j = ab; j < ae; ++j) s.bits[allowed.ids[j] >> 6] = 0;
    for (int32_t j = bb; j < be; ++j) s.bias[bias.ids[j]] = 0.0f;
    isa.values(s.gvals.data(), s.gids.data(), n, k, P);
    return;
  }

  bool any_bias = false;
  for (int32_t j = bb; j < be; ++j) {
    const int32_t id = bias.ids[j];
    if (id < t.lo || id >= t.hi) continue;
    s.bias[id] += bias.values[j];
    s.bias_blk[id / kBlock] = 1;
    any_bias = true;
  }
  if (t.mode == Mode::kMasked) {
    for (int32_t j = ab; j < ae; ++j) {
      const int32_t id = allowed.ids[j];
      if (id >= t.lo && id < t.hi) s.bits[id >> 6] |= uint64_t(1) << (id & 63);
    }
  }
  DenseArgs a;
  a.row = row;
  a.dtype = dtype;
  a.lo = t.lo;
  a.hi = t.hi;
  a.k = k;
  a.bias = any_bias ? s.bias.data() : nullptr;
  a.bias_blk = any_bias ? s.bias_blk.data() : nullptr;
  a.bits = t.mode == Mode::kMasked ? s.bits.data() : nullptr;
  a.full = t.full;
  if (t.mode == Mode::kDense && t.full) a.k = 0;
  isa.dense(a, P);
  if (t.mode == Mode::kMasked)
    for (int32_t j = ab; j < ae; ++j) s.bits[allowed.ids[j] >> 6] = 0;
  if (any_bias) {
    for (int32_t j = bb; j < be; ++j) {
      const int32_t id = bias.ids[j];
      if (id < t.lo || id >= t.hi) continue;
      s.bias[id] = 0.0f;
      s.bias_blk[id / kBlock] = 0;
    }
  }
}

// The unmasked lse of a row with a set, from its tasks' fm/fs: NaN when an element is NaN,
// +inf when one is +inf (the set's own errors were raised before).
float full_lse_of(const std::vector<Partial>& parts, int64_t t0, int64_t t1) {
  float m = -std::numeric_limits<float>::infinity();
  int32_t flags = 0;
  for (int64_t t = t0; t < t1; ++t) {
    m = std::max(m, parts[t].fm);
    flags |= parts[t].fflags;
  }
  if (flags & kFlagNaN) return std::numeric_limits<float>::quiet_NaN();
  if ((flags & kFlagPosInf) || std::isinf(m)) return m;
  double s = 0.0;
  for (int64_t t = t0; t < t1; ++t)
    if (!std::isinf(parts[t].fm)) s += parts[t].fs * std::exp((double)parts[t].fm - (double)m);
  return (float)((double)m + std::log(s));
}

void check_compact(const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& ids,
                   const c10::optional<at::Tensor>& values, int64_t B, const char* what,
                   const at::Device& dev) {
  TORCH_CHECK(offsets.has_value() == ids.has_value(), what, ": offsets and ids go together");
  if (!offsets) return;
  TORCH_CHECK(offsets->device() == dev && ids->device() == dev, what,
              ": must be on the logits' device");
  TORCH_CHECK(offsets->scalar_type() == at::kInt && ids->scalar_type() == at::kInt, what,
              ": offsets and ids must be int32");
  TORCH_CHECK(offsets->dim() == 1 && offsets->size(0) == B + 1, what, ": offsets must be [B+1]");
  TORCH_CHECK(ids->dim() == 1 && offsets->is_contiguous() && ids->is_contiguous(), what,
              ": ids must be a contiguous 1-D tensor");
  if (values.has_value()) {
    TORCH_CHECK(values->device() == dev && values->scalar_type() == at::kFloat &&
                    values->dim() == 1 && values->size(0) == ids->size(0) &&
                    values->is_contiguous(),
                what, ": values must be contiguous fp32 [N] like ids");
  }
}

}  // namespace

std::string check_compact_cpu(const at::Tensor& offsets, const at::Tensor& ids,
                             const c10::optional<at::Tensor>& values, int64_t B, int64_t V) {
  // The same checks and words as freetoken/ops/topk.py's Python validator (tests hold them equal).
  TORCH_CHECK(offsets.device().is_cpu() && ids.device().is_cpu() &&
                  offsets.scalar_type() == at::kInt && ids.scalar_type() == at::kInt &&
                  offsets.is_contiguous() && ids.is_contiguous(),
              "check_compact: contiguous int32 CPU tensors only");
  std::ostringstream msg;
  if (offsets.dim() != 1 || offsets.size(0) != B + 1) {
    msg << "offsets must have B+1 = " << B + 1 << " entries, got " << offsets.numel();
    return msg.str();
  }
  if (ids.dim() != 1) return "ids must be 1-D";
  const int32_t* off = offsets.data_ptr<int32_t>();
  const int64_t n = ids.size(0);
  if (off[0] != 0 || off[B] != n) {
    msg << "offsets must run from 0 to len(ids) = " << n << ", got " << off[0] << ".." << off[B];
    return msg.str();
  }
  for (int64_t r = 0; r < B; ++r) {
    if (off[r + 1] < off[r]) {
      msg << "offsets must not decrease (row " << r << ": " << off[r] << " > " << off[r + 1]
          << ")";
      return msg.str();
    }
  }
  const int32_t* p = ids.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] < 0 || p[j] >= V) {
      int64_t row = 0;
      while (off[row + 1] <= j) ++row;
      msg << "ids[" << j << "] = " << p[j] << " (row " << row
          << ") is outside the vocabulary (0.." << V - 1 << ")";
      return msg.str();
    }
  }
  if (values.has_value()) {
    TORCH_CHECK(values->device().is_cpu() && values->scalar_type() == at::kFloat &&
                    values->is_contiguous(),
                "check_compact: values must be contiguous fp32 on the CPU");
    if (values->dim() != 1 || values->size(0) != n) {
      msg << "values must match ids, got " << values->numel() << " for " << n;
      return msg.str();
    }
    const float* v = values->data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) {
      if (!std::isfinite(v[j])) {
        msg << "values[" << j << "] is not finite";
        return msg.str();
      }
    }
  }
  return "";
}

void check_topk_args(const at::Tensor& logits, int64_t k,
                     const c10::optional<at::Tensor>& allowed_offsets,
                     const c10::optional<at::Tensor>& allowed_ids,
                     const c10::optional<at::Tensor>& bias_offsets,
                     const c10::optional<at::Tensor>& bias_ids,
                     const c10::optional<at::Tensor>& bias_values) {
  TORCH_CHECK(logits.dim() == 2, "topk_logprobs: logits must be [B, V], got ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous(), "topk_logprobs: logits must be contiguous");
  const auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "topk_logprobs: logits must be fp32, bf16 or fp16, got ", st);
  TORCH_CHECK(k >= 0 && k <= kMaxK, "topk_logprobs: k must be in 0..", kMaxK, ", got ", k);
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31),
              "topk_logprobs: V must be in 1..2^31-1");
  const int64_t B = logits.size(0);
  check_compact(allowed_offsets, allowed_ids, c10::nullopt, B, "topk_logprobs allowed",
                logits.device());
  TORCH_CHECK(bias_offsets.has_value() == bias_values.has_value(),
              "topk_logprobs logit_bias: offsets, ids and values go together");
  check_compact(bias_offsets, bias_ids, bias_values, B, "topk_logprobs logit_bias",
                logits.device());
}

std::vector<at::Tensor> topk_logprobs_cpu(const at::Tensor& logits, int64_t k,
                                          const c10::optional<at::Tensor>& allowed_offsets,
                                          const c10::optional<at::Tensor>& allowed_ids,
                                          const c10::optional<at::Tensor>& bias_offsets,
                                          const c10::optional<at::Tensor>& bias_ids,
                                          const c10::optional<at::Tensor>& bias_values,
                                          bool full_lse) {
  check_topk_args(logits, k, allowed_offsets, allowed_ids, bias_offsets, bias_ids, bias_values);
  TORCH_CHECK(logits.device().is_cpu(), "topk_logprobs_cpu: logits must be on the CPU");
  const int64_t B = logits.size(0), V = logits.size(1);
  const int32_t dtype = logits.scalar_type() == at::kFloat      ? kF32
                        : logits.scalar_type() == at::kBFloat16 ? kBF16
                                                                : kF16;
  Compact allowed, bias;
  if (allowed_offsets) {
    allowed.offsets = allowed_offsets->data_ptr<int32_t>();
    allowed.ids = allowed_ids->data_ptr<int32_t>();
  }
  if (bias_offsets) {
    bias.offsets = bias_offsets->data_ptr<int32_t>();
    bias.ids = bias_ids->data_ptr<int32_t>();
    bias.values = bias_values->data_ptr<float>();
  }

  // Plan: a short allowed list is gathered (one task); a dense row (no mask, or a set of
  // >= V/16 ids, kept as a bitmask) is cut into chunks of kChunkBlocks blocks, which the
  // threads share. NOTE: the chunks depend on V alone, never on the row count or the threads:
  // a row's lse (its chunks' sums merged in chunk order) then has the same bits whatever runs
  // beside it (batch invariance, issue 23). Serial, the extra chunk merges cost little. With
  // full_lse, a masked row's chunks also sum the unmasked elements, and a gathered row gets
  // dense chunks of its own (k = 0) for that sum: it never reads the whole row otherwise.
  const int nthreads = at::get_num_threads();
  int64_t work = 0;  // in streamed-element units; a gathered element costs several
  for (int64_t r = 0; r < B; ++r) {
    const int64_t n = allowed.end(r) - allowed.begin(r);
    const bool gather = n > 0 && n * 16 < V;
    work += gather ? 8 * n + (full_lse ? V : 0) : V;
  }
  // Below ~200k elements (~50 us on one core) a helper's wake-up (tens of us under the PASSIVE
  // wait policy on a busy machine) eats the gain, so small steps stay on the caller's thread.
  const bool parallel = nthreads > 1 && work >= 200000;
  constexpr int64_t kChunkBlocks = 8;  // 8192 logits: 6 chunks of a 49152-token vocabulary
  const int64_t per_chunk = kChunkBlocks * kBlock;
  std::vector<Task> tasks;
  std::vector<int64_t> row_task(B + 1);
  tasks.reserve(B * ((V + per_chunk - 1) / per_chunk));
  for (int64_t r = 0; r < B; ++r) {
    row_task[r] = (int64_t)tasks.size();
    const int64_t n = allowed.end(r) - allowed.begin(r);
    if (n > 0 && n * 16 < V) {
      tasks.push_back(Task{r, 0, V, Mode::kGather, false});
      if (full_lse)  // after the gather task: the row's first task holds its top-k
        for (int64_t lo = 0; lo < V; lo += per_chunk)
          tasks.push_back(Task{r, lo, std::min(V, lo + per_chunk), Mode::kDense, true});
      continue;
    }
    const Mode mode = n > 0 ? Mode::kMasked : Mode::kDense;
    for (int64_t lo = 0; lo < V; lo += per_chunk)
      tasks.push_back(Task{r, lo, std::min(V, lo + per_chunk), mode, full_lse && n > 0});
  }
  row_task[B] = (int64_t)tasks.size();

  std::vector<Partial> parts(tasks.size());
  const IsaKernels isa = kernels_for(current_isa());  // follows set_cpu_isa
  const char* base = (const char*)logits.data_ptr();
  const int64_t row_bytes = V * logits.element_size();
  const int64_t ntasks = (int64_t)tasks.size();
  auto one = [&](int64_t t) {
    run_task(isa, tasks[t], base, row_bytes, dtype, V, (int32_t)k, allowed, bias, &parts[t]);
  };
  if (parallel && ntasks > 1) {
    TaskPool::get().run(ntasks, nthreads, std::function<void(int64_t)>(one));
  } else {
    for (int64_t t = 0; t < ntasks; ++t) one(t);
  }

  auto ids = at::empty({B, k}, logits.options().dtype(at::kLong));
  auto lps = at::empty({B, k}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({B}, logits.options().dtype(at::kFloat));
  auto full = full_lse ? at::empty({B}, logits.options().dtype(at::kFloat)) : at::Tensor();
  int64_t* ids_p = ids.data_ptr<int64_t>();
  float* lps_p = lps.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  float* full_p = full_lse ? full.data_ptr<float>() : nullptr;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // a gathered row's unmasked-sum chunks hold no part of its set
  auto sum_only = [&](int64_t t) { return tasks[t].mode == Mode::kDense && tasks[t].full; };
  for (int64_t r = 0; r < B; ++r) {
    const int64_t t0 = row_task[r], t1 = row_task[r + 1];
    Partial* P = &parts[t0];
    float m = kNegInf;
    int32_t flags = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (sum_only(t)) continue;
      m = std::max(m, parts[t].m);
      flags |= parts[t].flags;
    }
    TORCH_CHECK(!(flags & kFlagNaN), "topk_logprobs: row ", r, " has NaN logits");
    TORCH_CHECK(!(flags & kFlagPosInf), "topk_logprobs: row ", r, " has a +inf logit");
    TORCH_CHECK(m != kNegInf, "topk_logprobs: row ", r,
                " has logit -inf for every token of its set");
    double s = 0.0;
    for (int64_t t = t0; t < t1; ++t)
      if (!sum_only(t) && parts[t].m != kNegInf)
        s += parts[t].s * std::exp((double)parts[t].m - (double)m);
    for (int64_t t = t0 + 1; t < t1; ++t)
      for (int32_t j = 0; j < parts[t].cnt; ++j)
        topk_insert(P, (int32_t)k, parts[t].vals[j], parts[t].ids[j]);
    const double l = (double)m + std::log(s);
    lse_p[r] = (float)l;
    if (full_p) full_p[r] = tasks[t0].mode == Mode::kDense ? (float)l : full_lse_of(parts, t0, t1);
    for (int64_t j = 0; j < k; ++j) {
      if (j < P->cnt) {
        ids_p[r * k + j] = P->ids[j];
        lps_p[r * k + j] = (float)((double)P->vals[j] - l);
      } else {
        ids_p[r * k + j] = -1;
        lps_p[r * k + j] = kNegInf;
      }
    }
  }
  if (full_lse) return {ids, lps, lse, full};
  return {ids, lps, lse};
}

}  // namespace freetoken
