// The panel linear (linear_cpu.cpp): y = x @ W^T (+ bias) in fp32 over W packed once into
// column panels, for decode's few rows. Declarations for bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace freetoken {

// W [N, K] fp32 or bf16 -> the packed form: a 1-D tensor of W's dtype, a 64-byte header (int32
// words: magic, version, N, K, NR, number of panels, dtype 0 fp32 / 1 bf16) then ceil(N / NR)
// panels [K, NR], columns >= N zero.
at::Tensor panel_pack_cpu(const at::Tensor& weight);

// {N, K} of a packed tensor or a GGUF descriptor (gguf_linear.h; checks its header).
std::vector<int64_t> panel_shape_cpu(const at::Tensor& packed);

// x [M, K] contiguous, bias [N] or none, both of the weight's dtype (fp32 for a GGUF
// descriptor: gguf_matrix_linear) -> y [M, N] of that dtype (fp32 sums; bf16 y is their one
// rounding).
at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias);

}  // namespace freetoken
