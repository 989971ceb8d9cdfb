// Torch glue for the CUDA kernel: tensor checks, outputs, workspace, the current stream.
// Built only against a CUDA torch (setup.py adds it with -DWITH_CUDA); topk_kernel.cu has no
// torch headers.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "topk/topk.h"
#include "topk/topk_torch.h"
#include "topk_cuda.h"

namespace freetoken {

std::vector<at::Tensor> topk_logprobs_cuda(const at::Tensor& logits, int64_t k,
                                           const c10::optional<at::Tensor>& allowed_offsets,
                                           const c10::optional<at::Tensor>& allowed_ids,
                                           const c10::optional<at::Tensor>& bias_offsets,
                                           const c10::optional<at::Tensor>& bias_ids,
                                           const c10::optional<at::Tensor>& bias_values,
                                           bool full_lse) {
  check_topk_args(logits, k, allowed_offsets, allowed_ids, bias_offsets, bias_ids, bias_values);
  TORCH_CHECK(logits.is_cuda(), "topk_logprobs_cuda: logits must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V <= cuda::topk_max_vocab((int32_t)k), "topk_logprobs (CUDA): V = ", V,
              " is above this kernel's limit for k = ", k, " (", cuda::topk_max_vocab((int32_t)k),
              ")");
  const auto st = logits.scalar_type();
  const int64_t n_allowed = allowed_ids ? allowed_ids->numel() : 0;
  auto ids = at::empty({B, k}, logits.options().dtype(at::kLong));
  auto lps = at::empty({B, k}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({B}, logits.options().dtype(at::kFloat));
  auto full = full_lse ? at::empty({B}, logits.options().dtype(at::kFloat)) : at::Tensor();
  auto status = at::empty({B}, logits.options().dtype(at::kInt));
  auto ws = at::empty({(int64_t)cuda::topk_workspace_bytes(B, V, n_allowed)},
                      logits.options().dtype(at::kByte));
  cuda::TopkArgs a{};
  a.logits = logits.data_ptr();
  a.dtype = st == at::kFloat ? kF32 : st == at::kBFloat16 ? kBF16 : kF16;
  a.B = B;
  a.V = V;
  a.k = (int32_t)k;
  if (allowed_offsets) {
    a.allowed_offsets = allowed_offsets->data_ptr<int32_t>();
    a.allowed_ids = allowed_ids->data_ptr<int32_t>();
    a.n_allowed = n_allowed;
  }
  if (bias_offsets) {
    a.bias_offsets = bias_offsets->data_ptr<int32_t>();
    a.bias_ids = bias_ids->data_ptr<int32_t>();
    a.bias_values = bias_values->data_ptr<float>();
  }
  a.out_ids = ids.data_ptr<int64_t>();
  a.out_logprobs = lps.data_ptr<float>();
  a.out_lse = lse.data_ptr<float>();
  a.out_full = full_lse ? full.data_ptr<float>() : nullptr;
  a.out_status = status.data_ptr<int32_t>();
  a.workspace = ws.data_ptr();
  const cudaError_t err = cuda::topk_launch(a, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "topk_logprobs (CUDA): launch failed: ", cudaGetErrorString(err));
  if (full_lse) return {ids, lps, lse, full, status};
  return {ids, lps, lse, status};
}

}  // namespace freetoken
