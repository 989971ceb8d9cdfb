// The block-resident linear (gguf_linear.cpp): y = x @ W^T (+ bias) in fp32 with W read from its
// GGUF blocks where the file's memory map has them. Declarations for bindings.cpp and the panel
// linear's dispatch (linear_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace freetoken {

// W [N, K] as the rows of a GGUF file: row n's blocks at base + row_offsets[n], rows
// [ends[s - 1], ends[s]) of type types[s] -> the descriptor (a 1-D uint8 tensor holding the row
// addresses: base must outlive it).
at::Tensor gguf_matrix_pack(const at::Tensor& base, const at::Tensor& row_offsets,
                            const std::vector<std::string>& types,
                            const std::vector<int64_t>& ends, int64_t K);

// The types gguf_matrix_pack takes.
std::vector<std::string> gguf_matrix_types();

// True when `weight` is a descriptor from gguf_matrix_pack.
bool is_gguf_matrix(const at::Tensor& weight);

// {N, K} of a descriptor (checked).
std::vector<int64_t> gguf_matrix_shape(const at::Tensor& weight);

// x [M, K] fp32 contiguous, bias [N] fp32 or none -> y [M, N] fp32.
at::Tensor gguf_matrix_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias);

}  // namespace freetoken
