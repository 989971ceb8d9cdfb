// The fused elementwise ops of the Llama forward (elementwise_cpu.cpp): torch-facing declarations.
#pragma once

#include <torch/extension.h>

namespace freetoken {

// fp32 or bf16, CPU only. Each matches the torch twin in freetoken/ops/elementwise.py op by op
// (the same intermediate roundings).
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

}  // namespace freetoken
