// One decoder layer of the Llama forward in one call on the CPU (decoder_layer_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace freetoken {

class DecoderLayerCpu {
 public:
  // weights, few_rows, biases: 4 each, for qkv, o, gate_up, down (None: absent). weights are
  // the main panel forms (None where the main form is not panels, e.g. bf16 oneDNN), few_rows
  // the forms for steps of at most few_rows_max rows. window: the sliding window, 0 = none.
  DecoderLayerCpu(at::Tensor input_norm, at::Tensor post_norm,
                  std::vector<c10::optional<at::Tensor>> weights,
                  std::vector<c10::optional<at::Tensor>> few_rows,
                  std::vector<c10::optional<at::Tensor>> biases, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
                  double scale, int64_t window, int64_t few_rows_max);

  // True when every projection has a panel form for a step of `rows` rows.
  bool serves(int64_t rows) const;

  // x [T, H]: the previous layer's MLP output (the embeddings at layer 0, residual None);
  // residual [T, H]: the stream before it, updated in place. -> (this layer's MLP output,
  // the residual stream). K/V of the step are written into the pools at slot_mapping.
  // out_rows [R] (with out_query_start_loc [S + 1]): only these rows past the attention's K/V,
  // each the last of its sequence's rows (out_query_start_loc: 0, 1, ..., R; a sequence may have
  // none): -> ([R, H], the stream's rows out_rows). The model's last layer, where only the rows
  // whose logits are needed go on (as llama.cpp's inp_out_ids).
  std::tuple<at::Tensor, at::Tensor> forward(
      const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
      const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
      const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& query_start_loc, const at::Tensor& slot_mapping,
      const c10::optional<at::Tensor>& out_rows = c10::nullopt,
      const c10::optional<at::Tensor>& out_query_start_loc = c10::nullopt) const;

 private:
  struct Projection {
    at::Tensor main, few_rows, bias;  // undefined: absent
  };
  const at::Tensor* form(int i, int64_t rows) const;
  const at::Tensor& checked_form(int i, int64_t rows) const;  // form, or an error
  c10::optional<at::Tensor> bias(int i) const;
  at::Tensor project(int i, const at::Tensor& x) const;
  // The MLP's down projection of silu(gate) * up (an int8 matrix takes gate_up whole:
  // int8_silu_linear).
  at::Tensor down_project(const at::Tensor& gate_up) const;

  at::Tensor input_norm_, post_norm_;
  Projection proj_[4];
  int64_t nh_, kvh_, hd_, inter_;
  double eps_, scale_;
  int64_t window_, few_rows_max_;
};

// The model's decoder layers in order in one call: layer i reads k_caches[i], v_caches[i], the
// first starts the residual stream. -> (the last layer's MLP output, the residual stream), or
// nullopt, having run nothing, where a layer does not serve a step of x's rows (the caller then
// takes the layers one by one). Why: one return to Python a step instead of one a layer.
// out_rows, out_query_start_loc: the last layer's (DecoderLayerCpu::forward); the results are
// then those rows'.
c10::optional<std::tuple<at::Tensor, at::Tensor>> decoder_stack_forward(
    const std::vector<const DecoderLayerCpu*>& layers, const at::Tensor& x,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& out_rows = c10::nullopt,
    const c10::optional<at::Tensor>& out_query_start_loc = c10::nullopt);

}  // namespace freetoken
