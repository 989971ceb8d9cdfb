// Torch-facing declarations shared by bindings.cpp, ops_cpu.cpp and cuda/ops_cuda_glue.cpp.
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

// -> {ids int64 [B,k], logprobs fp32 [B,k], lse fp32 [B]}; errors (NaN, +inf, an all -inf set)
// raise.
std::vector<at::Tensor> topk_logprobs_cpu(const at::Tensor& logits, int64_t k,
                                          const c10::optional<at::Tensor>& allowed_offsets,
                                          const c10::optional<at::Tensor>& allowed_ids,
                                          const c10::optional<at::Tensor>& bias_offsets,
                                          const c10::optional<at::Tensor>& bias_ids,
                                          const c10::optional<at::Tensor>& bias_values);

#ifdef WITH_CUDA
// -> {ids, logprobs, lse, status int32 [B]}: asynchronous; status[r] != 0 (kFlag* bits, 4 = all
// -inf) marks a row whose outputs are invalid; the caller raises.
std::vector<at::Tensor> topk_logprobs_cuda(const at::Tensor& logits, int64_t k,
                                           const c10::optional<at::Tensor>& allowed_offsets,
                                           const c10::optional<at::Tensor>& allowed_ids,
                                           const c10::optional<at::Tensor>& bias_offsets,
                                           const c10::optional<at::Tensor>& bias_ids,
                                           const c10::optional<at::Tensor>& bias_values);
#endif

// Validates one compact per-row list (contiguous int32 CPU tensors): "" when fine, else the
// message freetoken/ops.py raises as ValueError.
std::string check_compact_cpu(const at::Tensor& offsets, const at::Tensor& ids,
                              const c10::optional<at::Tensor>& values, int64_t B, int64_t V);

// Fused elementwise ops of the Llama forward (see elementwise_cpu.cpp), fp32 or bf16, CPU only.
// Each matches the torch twin in freetoken/ops.py op by op (the same intermediate roundings).
// RMSNorm over the rows of x [T, H] (stride(1) == 1, any row stride); weight [H] in x's dtype or
// fp32 -> [T, H] in promote(x, weight): weight * round_x(x * rsqrt(mean(x^2) + eps)).
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
// The same after the residual add: residual [T, H] (x's dtype) := x + residual, in place; -> the
// RMSNorm of the new residual.
at::Tensor add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, double eps);
// gate_up [T, 2I] (rows contiguous) -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I].
at::Tensor silu_mul_cpu(const at::Tensor& gate_up, int64_t intermediate_size);
// In place: x <- x * cos + rotate_half(x) * sin on every head of q [T, nh, hd] and k [T, kvh, hd]
// (stride(2) == 1, stride(1) == hd, any stride(0): views into one qkv output); cos, sin [T, hd] or
// [T, 1, hd] in q's dtype.
void rope_cpu_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
               const at::Tensor& sin);

std::string cpu_isa();
void set_cpu_isa(const std::string& name);

}  // namespace freetoken
