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
// Rows [t0, t1) of silu_mul_cpu's fp32 result, on the calling thread, into out [t1 - t0, I]:
// gate_up's rows at a row stride of `stride` floats. The same bits (the same ISA variant), for an
// op that takes the activation a row at a time (the int8 down projection, int8_linear.h).
void silu_mul_rows_fp32(const float* gate_up, int64_t stride, int64_t I, int64_t t0, int64_t t1,
                        float* out);
// In place: x <- x * cos + rotate_half(x) * sin on every head of q [T, nh, hd] and k [T, kvh, hd]
// (stride(2) == 1, stride(1) == hd, any stride(0): views into one qkv output); cos, sin [T, hd] or
// [T, 1, hd] in q's dtype.
void rope_cpu_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
               const at::Tensor& sin);

}  // namespace freetoken
