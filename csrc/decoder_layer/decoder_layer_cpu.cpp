// One decoder layer of the Llama forward on the CPU in one call (freetoken/model/llama.py,
// DecoderLayer.forward), for layers whose four projections are panel-packed for the step's rows:
//
//   h = RMSNorm(x + residual)        (layer 0: RMSNorm(x), the residual stream starts as x)
//   q, k, v = split(h Wqkv^T + b);  RoPE on q, k;  K/V written at slot_mapping;  paged attention
//   h = RMSNorm(residual += attn Wo^T + b)
//   x' = (silu(gate) * up) Wdown^T + b,   gate | up = h Wgate_up^T + b
//   (an int8 Wdown takes gate_up whole: int8_silu_linear, silu_mul's product made a row at a
//   time into its quantization; the same bits)
//
// Why: called from Python the same kernels are nine dispatches a layer, each through nn.Module,
// freetoken.ops and pybind11, plus the views between them: on SmolLM2 ~1.5-2 ms of a 17-18 ms
// decode step of 8 rows (~50-60 us a layer), ~1.1 ms of a 6.7 ms single-stream step.
//
// Numerics: the Python path's exactly: the same functions in the same order on the same
// tensors (tests/model/test_decoder_layer.py checks bitwise equality). Form per projection: the
// few-rows form (GGUF blocks, bf16 panels) when the step has at most few_rows_max rows, else
// the main panels; a projection with neither for the step's rows (bf16 oneDNN weights, many
// rows) means serves() is false and the caller keeps the Python path.
// decoder_stack_forward: every layer of a model in order in one call (one return to Python a
// step).
#include "decoder_layer/decoder_layer_cpu.h"

#include "attention/paged_attention_cpu.h"
#include "elementwise/elementwise_cpu.h"
#include "linear/int8_linear.h"
#include "linear/linear_cpu.h"

namespace freetoken {

namespace {

// N and K of a panel-packed weight (pack_panels) or a GGUF descriptor (gguf_matrix), checked.
std::pair<int64_t, int64_t> panel_nk(const at::Tensor& packed) {
  const std::vector<int64_t> nk = panel_shape_cpu(packed);
  return {nk[0], nk[1]};
}

}  // namespace

DecoderLayerCpu::DecoderLayerCpu(at::Tensor input_norm, at::Tensor post_norm,
                                 std::vector<c10::optional<at::Tensor>> weights,
                                 std::vector<c10::optional<at::Tensor>> few_rows,
                                 std::vector<c10::optional<at::Tensor>> biases,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t intermediate_size, double eps, double scale,
                                 int64_t window, int64_t few_rows_max)
    : input_norm_(std::move(input_norm)),
      post_norm_(std::move(post_norm)),
      nh_(num_heads),
      kvh_(num_kv_heads),
      hd_(head_dim),
      inter_(intermediate_size),
      eps_(eps),
      scale_(scale),
      window_(window),
      few_rows_max_(few_rows_max) {
  TORCH_CHECK_VALUE(weights.size() == 4 && few_rows.size() == 4 && biases.size() == 4,
                    "DecoderLayer: weights, few_rows and biases are lists of 4 (qkv, o, "
                    "gate_up, down)");
  TORCH_CHECK_VALUE(nh_ >= 1 && kvh_ >= 1 && nh_ % kvh_ == 0 && hd_ >= 2 && hd_ % 2 == 0 &&
                        inter_ >= 1 && window_ >= 0 && few_rows_max_ >= 0,
                    "DecoderLayer: bad shape arguments (num_heads ", nh_, ", num_kv_heads ", kvh_,
                    ", head_dim ", hd_, ", intermediate_size ", inter_, ", window ", window_, ")");
  TORCH_CHECK_VALUE(input_norm_.dim() == 1 && post_norm_.dim() == 1 &&
                        input_norm_.sizes() == post_norm_.sizes(),
                    "DecoderLayer: input_norm and post_norm must be [hidden] of one size");
  const int64_t H = input_norm_.size(0), q_size = nh_ * hd_, kv_size = kvh_ * hd_;
  const std::pair<int64_t, int64_t> shapes[4] = {
      {q_size + 2 * kv_size, H}, {H, q_size}, {2 * inter_, H}, {H, inter_}};
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  for (int i = 0; i < 4; ++i) {
    Projection& p = proj_[i];
    for (auto [src, dst, what] : {std::tuple{&weights[i], &p.main, "weights"},
                                  std::tuple{&few_rows[i], &p.few_rows, "few_rows"}}) {
      if (!src->has_value() || !(*src)->defined()) continue;
      const auto nk = panel_nk(**src);
      TORCH_CHECK_VALUE(nk == shapes[i], "DecoderLayer: ", what, "[", i, "] (", names[i],
                        ") is packed [", nk.first, ", ", nk.second, "]; the layer needs [",
                        shapes[i].first, ", ", shapes[i].second, "]");
      *dst = **src;
    }
    if (biases[i].has_value() && biases[i]->defined()) {
      TORCH_CHECK_VALUE(biases[i]->dim() == 1 && biases[i]->size(0) == shapes[i].first,
                        "DecoderLayer: biases[", i, "] (", names[i], ") must be [",
                        shapes[i].first, "]");
      p.bias = *biases[i];
    }
  }
}

const at::Tensor* DecoderLayerCpu::form(int i, int64_t rows) const {
  const Projection& p = proj_[i];
  if (p.few_rows.defined() && rows <= few_rows_max_) return &p.few_rows;
  return p.main.defined() ? &p.main : nullptr;
}

bool DecoderLayerCpu::serves(int64_t rows) const {
  for (int i = 0; i < 4; ++i)
    if (form(i, rows) == nullptr) return false;
  return true;
}

const at::Tensor& DecoderLayerCpu::checked_form(int i, int64_t rows) const {
  const at::Tensor* w = form(i, rows);
  TORCH_CHECK_VALUE(w != nullptr, "DecoderLayer: no panel form of projection ", i, " for ", rows,
                    " rows (check serves() first)");
  return *w;
}

c10::optional<at::Tensor> DecoderLayerCpu::bias(int i) const {
  const at::Tensor& b = proj_[i].bias;
  return b.defined() ? c10::optional<at::Tensor>(b) : c10::nullopt;
}

at::Tensor DecoderLayerCpu::project(int i, const at::Tensor& x) const {
  return panel_linear_cpu(x, checked_form(i, x.size(0)), bias(i));
}

at::Tensor DecoderLayerCpu::down_project(const at::Tensor& gate_up) const {
  const at::Tensor& w = checked_form(3, gate_up.size(0));
  if (is_int8_matrix(w)) return int8_silu_linear(gate_up, w, bias(3));
  return project(3, silu_mul_cpu(gate_up, inter_));
}

std::tuple<at::Tensor, at::Tensor> DecoderLayerCpu::forward(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const at::Tensor& slot_mapping,
    const c10::optional<at::Tensor>& out_rows,
    const c10::optional<at::Tensor>& out_query_start_loc) const {
  TORCH_CHECK_VALUE(x.dim() == 2, "DecoderLayer: x must be [T, hidden], got ", x.dim(), "-D");
  TORCH_CHECK_VALUE(out_rows.has_value() == out_query_start_loc.has_value(),
                    "DecoderLayer: pass out_rows and out_query_start_loc together, or neither");
  if (out_rows.has_value())
    TORCH_CHECK_VALUE(out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong,
                      "DecoderLayer: out_rows must be int64 [R]");
  const int64_t T = x.size(0), q_size = nh_ * hd_, kv_size = kvh_ * hd_;
  const bool first = !residual.has_value() || !residual->defined();
  // The residual stream: x itself at layer 0 (updated in place below, as in Python).
  const at::Tensor stream = first ? x : *residual;
  at::Tensor h = first ? rms_norm_cpu(x, input_norm_, eps_)
                       : add_rms_norm_cpu(x, stream, input_norm_, eps_);
  const at::Tensor qkv = project(0, h);  // [T, q + 2 kv]
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, nh_, hd_});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kvh_, hd_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kvh_, hd_});
  rope_cpu_(q, k, cos, sin);
  if (out_rows.has_value()) {
    // Every row's K/V into the pools; the attention and the MLP only at out_rows.
    const at::Tensor attn = paged_attention_cpu(q.index_select(0, *out_rows), k_cache, v_cache,
                                                block_tables, seq_lens, *out_query_start_loc,
                                                scale_, window_, k, v, slot_mapping);  // [R, nh, hd]
    const int64_t R = out_rows->size(0);
    const at::Tensor kept = stream.index_select(0, *out_rows);
    h = add_rms_norm_cpu(project(1, attn.view({R, q_size})), kept, post_norm_, eps_);
    return {down_project(project(2, h)), kept};
  }
  const at::Tensor attn = paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens,
                                              query_start_loc, scale_, window_, k, v,
                                              slot_mapping);  // [T, nh, hd]
  const at::Tensor o = project(1, attn.view({T, q_size}));
  h = add_rms_norm_cpu(o, stream, post_norm_, eps_);
  return {down_project(project(2, h)), stream};
}

c10::optional<std::tuple<at::Tensor, at::Tensor>> decoder_stack_forward(
    const std::vector<const DecoderLayerCpu*>& layers, const at::Tensor& x,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& out_rows,
    const c10::optional<at::Tensor>& out_query_start_loc) {
  TORCH_CHECK_VALUE(!layers.empty() && k_caches.size() == layers.size() &&
                        v_caches.size() == layers.size(),
                    "decoder_stack: ", layers.size(), " layers, ", k_caches.size(),
                    " k_caches and ", v_caches.size(), " v_caches (one of each a layer)");
  TORCH_CHECK_VALUE(x.dim() == 2, "decoder_stack: x must be [T, hidden], got ", x.dim(), "-D");
  for (const DecoderLayerCpu* layer : layers) {
    TORCH_CHECK_VALUE(layer != nullptr, "decoder_stack: a layer is None");
    if (!layer->serves(x.size(0))) return c10::nullopt;
  }
  if (out_rows.has_value() && !layers.back()->serves(out_rows->size(0))) return c10::nullopt;
  std::tuple<at::Tensor, at::Tensor> out{x, at::Tensor()};
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor& residual = std::get<1>(out);
    out = layers[i]->forward(std::get<0>(out),
                             residual.defined() ? c10::optional<at::Tensor>(residual)
                                                : c10::nullopt,
                             cos, sin, k_caches[i], v_caches[i], block_tables, seq_lens,
                             query_start_loc, slot_mapping,
                             i + 1 == layers.size() ? out_rows : c10::nullopt,
                             i + 1 == layers.size() ? out_query_start_loc : c10::nullopt);
  }
  return out;
}

}  // namespace freetoken
