// The int8 compute mode's linear (int8_linear.cpp): y = x @ W^T (+ bias) with x quantized to int8
// per block of 32 and W's integer codes, integer dot products (AVX512-VNNI where present), fp32
// scales per group. Declarations for bindings.cpp and the panel linear's dispatch (linear_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

namespace freetoken {

// W [N, K] as the rows of a GGUF file (the arguments of gguf_matrix_pack) -> the int8 matrix: the
// codes and scales repacked 16 outputs at a time (a 1-D uint8 tensor that owns them; base is
// only read here).
at::Tensor int8_matrix_pack(const at::Tensor& base, const at::Tensor& row_offsets,
                            const std::vector<std::string>& types,
                            const std::vector<int64_t>& ends, int64_t K);

// The GGUF types int8_matrix_pack takes.
std::vector<std::string> int8_matrix_types();

// Bits a weight of GGUF type `type` takes in an int8 matrix (codes and scales; benchmarks).
double int8_bits_per_weight(const std::string& type);

// True when `weight` is an int8 matrix from int8_matrix_pack.
bool is_int8_matrix(const at::Tensor& weight);

// {N, K} of an int8 matrix (checked).
std::vector<int64_t> int8_matrix_shape(const at::Tensor& weight);

// The repacked matrix back as arrays (for tests): codes u [N, K] uint8, scales a [N, K / 16] and
// offsets b [N, K / 16] fp32 (one per 16 weights: a group of 32 repeats its pair), and the
// integer code offset c [N] int32. Each weight is a * (u - c) + b, exactly the dequantized value.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_matrix_unpack(
    const at::Tensor& weight);

// A K-quant panel's own numbers (for tests): d and dmin [N, K / 256] fp32 (Q6_K: dmin 0), sc
// and mn [N, K / 16] int32 (a group's value on each of its 16s); zeros outside K-quant panels.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_matrix_superblocks(
    const at::Tensor& weight);

// x [M, K] fp32 -> its int8 codes [M, K] and scales [M, K / 32] (the activation quantization, per
// block of `block` = 32 or 256 values; a 256 block's scale repeated for each of its 32).
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x, int64_t block);

// x [M, K] fp32 contiguous, bias [N] fp32 or none -> y [M, N] fp32.
at::Tensor int8_matrix_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias);

// y = (silu(gate) * up) @ W^T (+ bias), gate | up = gate_up [M, 2K] fp32 (rows contiguous): the
// bits of int8_matrix_linear(silu_mul_cpu(gate_up, K), ...) without the activation stored whole
// (the int8 mode's down projection).
at::Tensor int8_silu_linear(const at::Tensor& gate_up, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias);

// True when this CPU runs the VNNI kernel (else the portable one: the same results).
bool int8_vnni_available();

// True when this CPU has AMX-INT8 and the process may use its tiles: the int8 linear then takes
// the AMX loop for steps of 32 rows and more (the same bits as the VNNI loop).
bool int8_amx_available();
// Allows (true, the default) or forbids the AMX loop; returns the previous setting (tests, A/B).
bool set_int8_amx(bool allowed);
// True when the int8 linear's 8-lane (AVX2) loop is in use and the CPU has AVX-VNNI: its steps
// are then vpdpbusd (the same bits as vpmaddubsw's).
bool int8_avx_vnni_available();
// Allows (true, the default) or forbids AVX-VNNI in the 8-lane loop; returns the previous setting
// (tests, A/B).
bool set_int8_avx_vnni(bool allowed);
// The instructions int8_peak_gops times, those of the fastest int8 loop in use: "tdpbssd
// (AMX-INT8)", "vpdpbusd (AVX512-VNNI)", "vpdpbusd (AVX-VNNI)", "vpmaddubsw+vpaddw (AVX2)", or ""
// (portable).
std::string int8_bound_loop();

// The int8 compute bound: giga int8 operations (2 a product) a second of `threads` threads each
// running `iters` rounds of register-only products in the instructions of the fastest loop the
// kernel runs: AMX tile products (16 x 16 x 64) where it takes the AMX loop, else 12 vpdpbusd
// (AVX512-VNNI), else 12 VEX vpdpbusd (AVX-VNNI), else 6 vpmaddubsw + vpaddw (AVX2) (benchmarks).
double int8_peak_gops(int64_t iters, int64_t threads);

}  // namespace freetoken
