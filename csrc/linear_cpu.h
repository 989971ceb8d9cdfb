// The panel linear (csrc/linear_cpu.cpp): y = x @ W^T (+ bias) in fp32 over W packed once into
// column panels, for decode's few rows. Declarations for bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace freetoken {

// W [N, K] fp32 -> the packed form: a 1-D fp32 tensor, a 64-byte header (int32 words: magic,
// version, N, K, NR, number of panels) then ceil(N / NR) panels [K, NR], columns >= N zero.
at::Tensor panel_pack_cpu(const at::Tensor& weight);

// {N, K} of a packed tensor (checks its header).
std::vector<int64_t> panel_shape_cpu(const at::Tensor& packed);

// x [M, K] fp32 contiguous, bias [N] fp32 or none -> y [M, N] fp32.
at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias);

}  // namespace freetoken
