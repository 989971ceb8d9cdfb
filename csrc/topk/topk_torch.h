// top-k's torch-facing declarations, shared by bindings.cpp, topk_cpu.cpp and
// cuda/ops_cuda_glue.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace freetoken {

void check_topk_args(const at::Tensor& logits, int64_t k,
                     const c10::optional<at::Tensor>& allowed_offsets,
                     const c10::optional<at::Tensor>& allowed_ids,
                     const c10::optional<at::Tensor>& bias_offsets,
                     const c10::optional<at::Tensor>& bias_ids,
                     const c10::optional<at::Tensor>& bias_values);

// -> {ids int64 [B,k], logprobs fp32 [B,k], lse fp32 [B]}, plus full fp32 [B] (the unmasked lse,
// topk/topk.h) with full_lse; errors (NaN, +inf, an all -inf set) raise.
std::vector<at::Tensor> topk_logprobs_cpu(const at::Tensor& logits, int64_t k,
                                          const c10::optional<at::Tensor>& allowed_offsets,
                                          const c10::optional<at::Tensor>& allowed_ids,
                                          const c10::optional<at::Tensor>& bias_offsets,
                                          const c10::optional<at::Tensor>& bias_ids,
                                          const c10::optional<at::Tensor>& bias_values,
                                          bool full_lse);

#ifdef WITH_CUDA
// -> {ids, logprobs, lse[, full], status int32 [B]}: asynchronous; status[r] != 0 (kFlag* bits,
// 4 = all -inf) marks a row whose outputs are invalid; the caller raises.
std::vector<at::Tensor> topk_logprobs_cuda(const at::Tensor& logits, int64_t k,
                                           const c10::optional<at::Tensor>& allowed_offsets,
                                           const c10::optional<at::Tensor>& allowed_ids,
                                           const c10::optional<at::Tensor>& bias_offsets,
                                           const c10::optional<at::Tensor>& bias_ids,
                                           const c10::optional<at::Tensor>& bias_values,
                                           bool full_lse);
#endif

// Validates one compact per-row list (contiguous int32 CPU tensors): "" when fine, else the
// message freetoken/ops/topk.py raises as ValueError.
std::string check_compact_cpu(const at::Tensor& offsets, const at::Tensor& ids,
                              const c10::optional<at::Tensor>& values, int64_t B, int64_t V);

}  // namespace freetoken
