// Paged attention on the CPU for any number of query tokens per sequence (paged_attention_cpu.cpp).
#pragma once

#include <torch/extension.h>

namespace freetoken {

// q [T, nh, hd] (fp32 / bf16 / fp16; heads contiguous, any row stride); k_cache, v_cache
// [NB, bs, kvh, hd] contiguous (fp32 / bf16 / fp16, one dtype); block_tables int64 [S, nb];
// seq_lens int64 [S]; query_start_loc int64 [S + 1]. Sequence s's query tokens are rows
// qsl[s] .. qsl[s+1]-1 at positions seq_len - n_q + i, causal over keys 0 .. their position
// (window > 0: only the last `window` of them), GQA (head h reads kv head h / (nh / kvh)).
// With k, v [T, kvh, hd] (heads contiguous, any row stride) and slot_mapping int64 [T], first
// writes the step's new K/V into the pools at those slots (cast to the pool's dtype), then
// attends; without them the pools are only read.
// -> [T, nh, hd] in q's dtype. Bad arguments raise ValueError (TORCH_CHECK_VALUE).
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               double scale, int64_t window,
                               const c10::optional<at::Tensor>& k = c10::nullopt,
                               const c10::optional<at::Tensor>& v = c10::nullopt,
                               const c10::optional<at::Tensor>& slot_mapping = c10::nullopt);

}  // namespace freetoken
