// GGUF blocks -> fp32: every weight exactly the value the gguf package's `dequantize` gives.
//
// Why: the loader turned each quantized tensor into fp32 through gguf.quants' numpy code, one
// temporary array per step of its formula; on a 1B-shaped Q4_K_M file that was most of the load.
// And it is the first piece of weights that stay in their blocks (issue 21): a kernel that
// dequantizes a tile of blocks on the fly needs each format's formula written once, exactly.
//
// Exactness: every format's weight is an integer code times one or two fp16-derived scales,
// plus at most one offset: Q4_1 / Q5_1 d * q + m; Q2_K / Q4_K / Q5_K (d * sc) * q - dmin * m;
// the rest (d * sc) * q or d * q. The products are exact in fp32 (an fp16 scale has 11
// significant bits, a sub-scale at most 7, a code at most 8; no product needs more than 24), so
// the one rounding is the offset's add, as in numpy: fused or not, the same fp32 value. fp16
// scales are widened exactly (subnormals too) by half_to_float below.
//
// Layouts are ggml's (ggml-common.h), read the way gguf-py's quants.py reads them; each block
// function fills one block's values in order. Rows are independent: the TaskPool splits them.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common/isa.h"
#include "common/task_pool.h"
#include "linear/gguf_blocks.h"
#include "linear/gguf_dequant.h"

namespace freetoken {
namespace {

using namespace gguf_blocks;  // NOLINT: the block functions, one per format

// --- the row loop, compiled once per ISA --------------------------------------------------------

struct Format {
  const char* name;
  int64_t block;        // values a block
  int64_t block_bytes;  // its bytes
  // blocks [b0, b1) of src into dst, per ISA
  void (*blocks_avx512)(const uint8_t*, float*, int64_t, int64_t);
  void (*blocks_avx2)(const uint8_t*, float*, int64_t, int64_t);
  void (*blocks_base)(const uint8_t*, float*, int64_t, int64_t);
};

// Blocks [b0, b1) of src into dst (Block values each); the block function inlined.
template <void (*F)(const uint8_t*, float*), int64_t Block, int64_t Bytes>
FT_INLINE void blocks_body(const uint8_t* src, float* dst, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) F(src + i * Bytes, dst + i * Block);
}
template <void (*F)(const uint8_t*, float*), int64_t Block, int64_t Bytes>
FT_TARGET_AVX512 void blocks_avx512(const uint8_t* s, float* d, int64_t b0, int64_t b1) {
  blocks_body<F, Block, Bytes>(s, d, b0, b1);
}
template <void (*F)(const uint8_t*, float*), int64_t Block, int64_t Bytes>
FT_TARGET_AVX2 void blocks_avx2(const uint8_t* s, float* d, int64_t b0, int64_t b1) {
  blocks_body<F, Block, Bytes>(s, d, b0, b1);
}
template <void (*F)(const uint8_t*, float*), int64_t Block, int64_t Bytes>
void blocks_base(const uint8_t* s, float* d, int64_t b0, int64_t b1) {
  blocks_body<F, Block, Bytes>(s, d, b0, b1);
}

template <void (*F)(const uint8_t*, float*), int64_t Block, int64_t Bytes>
constexpr Format format(const char* name) {
  return {name, Block, Bytes, &blocks_avx512<F, Block, Bytes>, &blocks_avx2<F, Block, Bytes>,
          &blocks_base<F, Block, Bytes>};
}

const Format kFormats[] = {
    format<f32, 1, 4>("F32"),          format<f16, 1, 2>("F16"),
    format<bf16, 1, 2>("BF16"),        format<q8_0, 32, 34>("Q8_0"),
    format<q4_0, 32, 18>("Q4_0"),      format<q4_1, 32, 20>("Q4_1"),
    format<q5_0, 32, 22>("Q5_0"),      format<q5_1, 32, 24>("Q5_1"),
    format<q2_k, 256, 84>("Q2_K"),     format<q3_k, 256, 110>("Q3_K"),
    format<q4_k, 256, 144>("Q4_K"),    format<q5_k, 256, 176>("Q5_K"),
    format<q6_k, 256, 210>("Q6_K"),    format<iq4_nl, 32, 18>("IQ4_NL"),
    format<iq4_xs, 256, 136>("IQ4_XS"),
};

const Format& find_format(const std::string& type) {
  for (const Format& f : kFormats)
    if (type == f.name) return f;
  std::string names;
  for (const Format& f : kFormats) names += std::string(names.empty() ? "" : ", ") + f.name;
  TORCH_CHECK(false, "gguf_dequantize: no kernel for GGUF type ", type, " (these have one: ",
              names, ")");
}

}  // namespace

std::vector<std::string> gguf_dequantize_types() {
  std::vector<std::string> out;
  for (const Format& f : kFormats) out.emplace_back(f.name);
  return out;
}

at::Tensor gguf_dequantize_cpu(const at::Tensor& rows, const std::string& type, int64_t K) {
  const Format& fmt = find_format(type);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2,
              "gguf_dequantize: rows must be a 2-D uint8 CPU tensor [N, row bytes]");
  TORCH_CHECK(K > 0 && K % fmt.block == 0, "gguf_dequantize: ", type, " rows hold a multiple of ",
              fmt.block, " values, not ", K);
  const int64_t N = rows.size(0), blocks_per_row = K / fmt.block;
  TORCH_CHECK(rows.size(1) == blocks_per_row * fmt.block_bytes, "gguf_dequantize: a ", type,
              " row of ", K, " values is ", blocks_per_row * fmt.block_bytes, " bytes, not ",
              rows.size(1));
  const at::Tensor src = rows.contiguous();
  at::Tensor out = at::empty({N, K}, at::kFloat);
  const uint8_t* s = src.data_ptr<uint8_t>();
  float* d = out.data_ptr<float>();
  const Isa isa = current_isa();  // cpuid-checked; follows set_cpu_isa
  auto* run = isa == Isa::kAvx512 ? fmt.blocks_avx512
              : isa == Isa::kAvx2 ? fmt.blocks_avx2
                                  : fmt.blocks_base;
  const int64_t total = N * blocks_per_row;
  // ~1 GB/s of blocks a thread at the slowest format: below ~64 KB one thread is faster.
  const int nthreads = rows.numel() < (64 << 10) ? 1 : at::get_num_threads();
  const int64_t n = nthreads == 1 ? 1 : 8 * nthreads;
  TaskPool::get().run(n, nthreads, [&](int64_t t) {
    run(s, d, total * t / n, total * (t + 1) / n);
  });
  return out;
}

}  // namespace freetoken
