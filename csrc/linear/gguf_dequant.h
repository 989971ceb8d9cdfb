// GGUF blocks -> fp32, exactly gguf.quants' dequantize (csrc/linear/gguf_dequant.cpp).
// Declarations for bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace freetoken {

// rows [N, K / block * block bytes] uint8 of GGUF type `type` -> [N, K] fp32.
at::Tensor gguf_dequantize_cpu(const at::Tensor& rows, const std::string& type, int64_t K);

// The type names gguf_dequantize_cpu takes.
std::vector<std::string> gguf_dequantize_types();

}  // namespace freetoken
