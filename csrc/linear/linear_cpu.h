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

// GGUF rows [N, K / 32 * block bytes] (uint8) of type "Q4_1" or "Q8_0" -> the packed form: a
// 1-D uint8 tensor, the same header (dtype 2 Q4_1 / 3 Q8_0) then the blocks regrouped per panel
// (csrc/linear/quant_linear_cpu.cpp); panel_linear_cpu takes fp32 x over it. release_rows: the
// rows are a view of a file's read-only memory map, whose pages are unmapped as packing consumes
// them (they must not be written or be anonymous memory: that would lose them).
at::Tensor gguf_pack_cpu(const at::Tensor& blocks, const std::string& type, int64_t K,
                         bool release_rows);

// {N, K} of a packed tensor (checks its header).
std::vector<int64_t> panel_shape_cpu(const at::Tensor& packed);

// x [M, K] contiguous, bias [N] or none, both of the weight's dtype -> y [M, N] of that dtype
// (fp32 sums; bf16 y is their one rounding).
at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias);

}  // namespace freetoken
