// The CUDA topk_logprobs launcher: raw device pointers and a stream, no torch headers, so that
// topk_kernel.cu compiles with a bare nvcc (scripts/check_cuda_compile.sh) and the torch glue
// (ops_cuda_glue.cpp) is the only part that needs a CUDA build of torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace freetoken {
namespace cuda {

struct TopkArgs {
  const void* logits;   // [B, V], dtype below, contiguous
  int32_t dtype;        // kF32 / kBF16 / kF16 (topk/topk.h)
  int64_t B, V;
  int32_t k;            // 0..kMaxK
  const int32_t* allowed_offsets;  // [B+1] or nullptr
  const int32_t* allowed_ids;      // [n_allowed]
  int64_t n_allowed;
  const int32_t* bias_offsets;     // [B+1] or nullptr
  const int32_t* bias_ids;
  const float* bias_values;
  int64_t* out_ids;     // [B, k]
  float* out_logprobs;  // [B, k]
  float* out_lse;       // [B]
  float* out_full;      // [B] or nullptr: the unmasked lse (topk/topk.h), NaN / +inf not errors
  int32_t* out_status;  // [B]: 0, or kFlagNaN | kFlagPosInf | 4 (every member -inf)
  void* workspace;      // topk_workspace_bytes(B, V, n_allowed) bytes, any contents
};

size_t topk_workspace_bytes(int64_t B, int64_t V, int64_t n_allowed);

// The largest V the kernel takes for this k (the merge holds (V / 4096) * k candidates).
int64_t topk_max_vocab(int32_t k);

// Enqueues the whole computation on `stream`; returns the first launch error, if any.
cudaError_t topk_launch(const TopkArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace freetoken
