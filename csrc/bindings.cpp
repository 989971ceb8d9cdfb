// freetoken._C: the Python surface. freetoken/ops/ is its only importer.
#include <torch/extension.h>

#include "attention/paged_attention_cpu.h"
#include "common/isa.h"
#include "common/task_pool.h"
#include "decoder_layer/decoder_layer_cpu.h"
#include "elementwise/elementwise_cpu.h"
#include "linear/gguf_dequant.h"
#include "linear/gguf_linear.h"
#include "linear/int8_linear.h"
#include "linear/linear_cpu.h"
#include "topk/topk.h"
#include "topk/topk_torch.h"

namespace {

std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k,
                                      const c10::optional<at::Tensor>& allowed_offsets,
                                      const c10::optional<at::Tensor>& allowed_ids,
                                      const c10::optional<at::Tensor>& bias_offsets,
                                      const c10::optional<at::Tensor>& bias_ids,
                                      const c10::optional<at::Tensor>& bias_values,
                                      bool full_lse) {
  if (logits.is_cuda()) {
#ifdef WITH_CUDA
    return freetoken::topk_logprobs_cuda(logits, k, allowed_offsets, allowed_ids, bias_offsets,
                                         bias_ids, bias_values, full_lse);
#else
    TORCH_CHECK(false, "freetoken._C was built without CUDA; use the torch twin on GPU tensors");
#endif
  }
  return freetoken::topk_logprobs_cpu(logits, k, allowed_offsets, allowed_ids, bias_offsets,
                                      bias_ids, bias_values, full_lse);
}

bool cuda_compiled() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

// NOTE: the calls that compute (a decoder layer, a linear, attention, top-k) release the GIL, so
// the server's event loop can write its responses while the engine thread is in a kernel;
// holding it, every SSE chunk waited for the step's next Python bytecode.
const auto kNoGil = py::call_guard<py::gil_scoped_release>();

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's fused mask / logit-bias / log-softmax / top-k kernel, CPU paged "
            "attention and fused elementwise ops";
  m.def("topk_logprobs", &topk_logprobs,
        "CPU: -> [ids, logprobs, lse] (+ full with full_lse); CUDA: + status",
        kNoGil,
        py::arg("logits"), py::arg("k"), py::arg("allowed_offsets") = py::none(),
        py::arg("allowed_ids") = py::none(), py::arg("bias_offsets") = py::none(),
        py::arg("bias_ids") = py::none(), py::arg("bias_values") = py::none(),
        py::arg("full_lse") = false);
  m.def("check_compact", &freetoken::check_compact_cpu,
        "validate (offsets, ids[, values]) for B rows and V ids: '' or the error message",
        py::arg("offsets"), py::arg("ids"), py::arg("values"), py::arg("B"), py::arg("V"));
  m.def("paged_attention", &freetoken::paged_attention_cpu,
        "CPU: causal attention of each sequence's query tokens over its paged K/V, read in "
        "place (after writing k, v at slot_mapping, if given) -> [T, nh, hd]", kNoGil,
        py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("window"),
        py::arg("k") = py::none(), py::arg("v") = py::none(),
        py::arg("slot_mapping") = py::none());
  m.def("rms_norm", &freetoken::rms_norm_cpu,
        "CPU: RMSNorm over the rows of x [T, H] -> [T, H] (weight's dtype if fp32)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &freetoken::add_rms_norm_cpu,
        "CPU: residual += x in place, -> RMSNorm(residual) [T, H]", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &freetoken::silu_mul_cpu,
        "CPU: gate_up [T, 2I] -> silu(gate) * up [T, I]", py::arg("gate_up"),
        py::arg("intermediate_size"));
  m.def("rope_", &freetoken::rope_cpu_,
        "CPU: rotate_half RoPE on q [T, nh, hd] and k [T, kvh, hd] in place", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"));
  m.def("cuda_compiled", &cuda_compiled);
  m.def("cpu_isa", &freetoken::cpu_isa, "the CPU kernel in use: avx512, avx2 or base");
  m.def("set_cpu_isa", &freetoken::set_cpu_isa,
        "force auto/avx512/avx2/base (freetoken.ops.configure(cpu_isa=...))");
  m.def("set_pool_poll_us", &freetoken::TaskPool::set_poll_us,
        "how long the kernels' pool polls before it sleeps (freetoken.ops.configure)",
        py::arg("us"));
  m.attr("max_k") = freetoken::kMaxK;
  m.def("panel_pack", &freetoken::panel_pack_cpu,
        "CPU: W [N, K] fp32 -> the packed panels (1-D fp32, a header then [N/16, K, 16])",
        py::arg("weight"));
  m.def("gguf_pack", &freetoken::gguf_pack_cpu,
        "CPU: GGUF Q4_1 / Q8_0 rows [N, K/32 * block bytes] uint8 -> packed panels (1-D uint8)",
        py::arg("blocks"), py::arg("type"), py::arg("K"), py::arg("release_rows") = false);
  m.def("gguf_dequantize", &freetoken::gguf_dequantize_cpu,
        "CPU: GGUF rows [N, K/block * block bytes] uint8 of a type -> [N, K] fp32, exactly the "
        "gguf package's dequantize", kNoGil, py::arg("rows"), py::arg("type"), py::arg("K"));
  m.def("gguf_dequantize_types", &freetoken::gguf_dequantize_types,
        "the GGUF types gguf_dequantize takes");
  m.def("gguf_matrix", &freetoken::gguf_matrix_pack,
        "CPU: a GGUF weight's rows where the file's mapping has them (base: the mapping, "
        "row_offsets: int64 [N], one type per segment ending at ends[s]) -> the descriptor that "
        "panel_linear takes (1-D uint8; base must outlive it)",
        py::arg("base"), py::arg("row_offsets"), py::arg("types"), py::arg("ends"),
        py::arg("K"));
  m.def("gguf_matrix_types", &freetoken::gguf_matrix_types, "the GGUF types gguf_matrix takes");
  m.def("is_gguf_matrix", &freetoken::is_gguf_matrix, "True for a descriptor from gguf_matrix",
        py::arg("weight"));
  m.def("int8_matrix", &freetoken::int8_matrix_pack,
        "CPU: a GGUF weight's rows (the arguments of gguf_matrix) -> the int8 matrix that "
        "panel_linear takes: codes and scales repacked 16 outputs at a time (1-D uint8, owns them)",
        kNoGil, py::arg("base"), py::arg("row_offsets"), py::arg("types"), py::arg("ends"),
        py::arg("K"));
  m.def("int8_matrix_types", &freetoken::int8_matrix_types, "the GGUF types int8_matrix takes");
  m.def("int8_bits_per_weight", &freetoken::int8_bits_per_weight,
        "bits a weight of a GGUF type takes in an int8 matrix (codes and scales)", py::arg("type"));
  m.def("is_int8_matrix", &freetoken::is_int8_matrix, "True for an int8 matrix",
        py::arg("weight"));
  m.def("int8_matrix_unpack", &freetoken::int8_matrix_unpack,
        "an int8 matrix -> (codes u [N, K] uint8, a [N, K/16], b [N, K/16] fp32, c [N] int32): "
        "each weight is a * (u - c) + b", py::arg("weight"));
  m.def("int8_matrix_superblocks", &freetoken::int8_matrix_superblocks,
        "an int8 matrix -> a K-quant's own numbers (d, dmin [N, K/256] fp32; sc, mn [N, K/16] "
        "int32; zeros outside K-quant panels): a = d * sc, b = -(dmin * mn)", py::arg("weight"));
  m.def("int8_quantize_rows", &freetoken::int8_quantize_rows,
        "x [M, K] fp32 -> (int8 codes [M, K], scales [M, K/32]): the int8 mode's activations, "
        "per block of 32 or 256", py::arg("x"), py::arg("block") = 32);
  m.def("int8_silu_linear", &freetoken::int8_silu_linear,
        "gate_up [M, 2K] fp32, an int8 matrix [N, K] -> (silu(gate) * up) W^T (+ bias) [M, N]: "
        "int8_linear of silu_mul's result, the activation never stored whole",
        py::arg("gate_up"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("int8_vnni_available", &freetoken::int8_vnni_available,
        "True when this CPU runs the int8 VNNI kernel");
  m.def("int8_amx_available", &freetoken::int8_amx_available,
        "True when this CPU has AMX-INT8 (and the process may use it): the int8 linear's AMX loop");
  m.def("set_int8_amx", &freetoken::set_int8_amx,
        "allows or forbids the int8 linear's AMX loop; returns the previous setting",
        py::arg("allowed"));
  m.def("int8_avx_vnni_available", &freetoken::int8_avx_vnni_available,
        "True when the int8 linear's AVX2 loop is in use and its steps are AVX-VNNI's vpdpbusd");
  m.def("set_int8_avx_vnni", &freetoken::set_int8_avx_vnni,
        "allows or forbids AVX-VNNI in the int8 linear's AVX2 loop; returns the previous setting",
        py::arg("allowed"));
  m.def("int8_bound_loop", &freetoken::int8_bound_loop,
        "the instructions int8_peak_gops times ('' for the portable loop)");
  m.def("int8_peak_gops", &freetoken::int8_peak_gops,
        "the int8 bound: GOP/s of threads x iters rounds of register products in the fastest "
        "int8 loop in use (AMX tiles, vpdpbusd, or vpmaddubsw + vpaddw; benchmarks)",
        kNoGil, py::arg("iters"), py::arg("threads"));
  m.def("panel_shape", &freetoken::panel_shape_cpu, "CPU: packed panels -> [N, K]",
        py::arg("packed"));
  py::class_<freetoken::DecoderLayerCpu>(
      m, "DecoderLayer",
      "CPU: one Llama decoder layer (norms, panel projections, RoPE, paged attention, SwiGLU) "
      "in one call")
      .def(py::init<at::Tensor, at::Tensor, std::vector<c10::optional<at::Tensor>>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    int64_t, int64_t, int64_t, int64_t, double, double, int64_t, int64_t>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("weights"),
           py::arg("few_rows"), py::arg("biases"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"),
           py::arg("eps"), py::arg("scale"), py::arg("window"), py::arg("few_rows_max"))
      .def("serves", &freetoken::DecoderLayerCpu::serves, py::arg("rows"))
      .def("forward", &freetoken::DecoderLayerCpu::forward, kNoGil, py::arg("x"),
           py::arg("residual"),
           py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"),
           py::arg("slot_mapping"), py::arg("out_rows") = py::none(),
           py::arg("out_query_start_loc") = py::none());
  m.def("decoder_stack", &freetoken::decoder_stack_forward,
        "CPU: the decoder layers in order in one call -> (out, residual), or None where a "
        "layer does not serve the step's rows",
        kNoGil, py::arg("layers"), py::arg("x"), py::arg("cos"), py::arg("sin"),
        py::arg("k_caches"), py::arg("v_caches"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("slot_mapping"), py::arg("out_rows") = py::none(),
        py::arg("out_query_start_loc") = py::none());
  m.def("panel_linear", &freetoken::panel_linear_cpu,
        "CPU: x [M, K] fp32 @ W^T (+ bias [N]) over packed panels -> [M, N]", kNoGil,
        py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
}
