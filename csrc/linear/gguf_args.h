// The argument checks that the two linears over a GGUF's rows share (gguf_linear.cpp: in place,
// exact; int8_linear.cpp: the int8 mode): the rows handed to a pack, the x and bias of a call,
// and the magic word that tells their 1-D uint8 tensors apart. `op` prefixes each message.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace freetoken {
namespace gguf_args {

// base: the file's mapping; row_offsets: int64 [N]; one type per segment ending at ends[s].
// Returns N.
inline int64_t check_rows(const at::Tensor& base, const at::Tensor& row_offsets,
                          const std::vector<std::string>& types, const std::vector<int64_t>& ends,
                          const char* op) {
  TORCH_CHECK_VALUE(base.device().is_cpu() && base.scalar_type() == at::kByte && base.dim() == 1,
                    op, ": base must be a 1-D uint8 CPU tensor (the file's mapping)");
  TORCH_CHECK_VALUE(row_offsets.device().is_cpu() && row_offsets.scalar_type() == at::kLong &&
                        row_offsets.dim() == 1 && row_offsets.numel() >= 1,
                    op, ": row_offsets must be a 1-D int64 CPU tensor [N >= 1]");
  const int64_t N = row_offsets.numel();
  TORCH_CHECK_VALUE(!types.empty() && types.size() == ends.size() && ends.back() == N,
                    op, ": types and ends are one per segment, the last end N = ", N);
  return N;
}

// bias [N] fp32 or none -> its pointer (null without one).
inline const float* check_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                        bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                    op, ": bias must be a contiguous fp32 CPU tensor [", N, "]");
  return bias->data_ptr<float>();
}

// x [M, K] fp32 contiguous, bias [N] fp32 or none -> the bias pointer (null without one).
inline const float* check_call(const at::Tensor& x, int64_t K, int64_t N,
                               const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.is_contiguous(),
                    op, ": x must be a contiguous 2-D fp32 CPU tensor [M, K]");
  TORCH_CHECK_VALUE(x.size(1) == K, op, ": x has K = ", x.size(1), ", the weight has K = ", K);
  return check_bias(bias, N, op);
}

// True when `w` is a 1-D uint8 CPU tensor of at least header_bytes that starts with `magic`.
inline bool has_magic(const at::Tensor& w, int32_t magic, int64_t header_bytes) {
  if (!w.defined() || !w.device().is_cpu() || w.scalar_type() != at::kByte || w.dim() != 1 ||
      w.numel() < header_bytes)
    return false;
  int32_t word;
  std::memcpy(&word, w.data_ptr(), 4);
  return word == magic;
}

}  // namespace gguf_args
}  // namespace freetoken
