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

// One query token per sequence over its paged context (see attention_cpu.cpp). q [S, nh, hd];
// k_cache, v_cache [NB, bs, kvh, hd] (same dtype as q); block_table int64 [S, max_blocks];
// seq_lens int64 [S] (the query is at seq_len - 1); window <= 0: none. -> [S, nh, hd].
at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_table,
                                      const at::Tensor& seq_lens, double scale, int64_t window);

std::string cpu_isa();
void set_cpu_isa(const std::string& name);

}  // namespace freetoken
