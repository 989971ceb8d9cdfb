"""ops.gguf_matrix + ops.panel_linear (csrc/linear/gguf_linear.cpp): a GGUF weight computed with
in place, in its blocks. Every format, on every ISA variant:
  * each weight is exactly the fp32 value dequantize_gguf (the gguf package's) gives: x = I makes
    every output one product, so y = W^T bit for bit;
  * products within fp32 rounding of an fp64 reference, q/k-style row orders, fused segments of
    mixed types, odd sizes, bias;
  * one summation order whatever the step: a row's outputs are the same bits alone, in any batch
    of rows (the few-rows and the many-rows loops), with 1 or 2 threads; AVX2 gives AVX-512's
    bits (both keep the same 16 lane sums).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_gguf_dequant import KERNEL_TYPES, SCALE_OFFSETS

import freetoken.ops as ops

pytestmark = pytest.mark.skipif(not ops.gguf_matrix_available("Q4_K"),
                                reason="needs freetoken._C")

RTOL = 1e-5  # |y - ref| <= RTOL * (|x| @ |W|^T): fp32 rounding of sums of ~1000 products


def block_of(type_: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_]][0]


def random_rows(type_: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8 of valid `type_` rows of k weights with moderate fp16 scales (zero,
    subnormal, negative, up to ~1): products stay finite, so one-hot rows read W exactly."""
    rng = np.random.default_rng(seed)

    def halfs(count: int, top: int) -> np.ndarray:
        bits = rng.integers(0, top, size=count, dtype=np.uint16)
        bits[: min(count, 3)] = [0x0000, 0x0001, 0x03FF][: min(count, 3)]
        return bits | (rng.integers(0, 2, size=count, dtype=np.uint16) << 15)

    if type_ == "F32":
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if type_ == "F16":
        return halfs(n * k, 0x3C00).reshape(n, k).view(np.uint8)
    if type_ == "BF16":
        bits = rng.integers(0x3000, 0x3F80, size=n * k, dtype=np.uint16)
        return (bits | (rng.integers(0, 2, size=n * k, dtype=np.uint16) << 15)).reshape(
            n, k).view(np.uint8)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_]]
    blocks = rng.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[type_]:
        blocks[:, off:off + 2] = halfs(blocks.shape[0], 0x3C00).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def matrix(rows_by_type: list[tuple[str, np.ndarray]], k: int, order=None, pad: int = 7):
    """(descriptor, mapping, W fp32): the segments' rows laid out after `pad` bytes in one
    mapping, row n of the weight at row order[n] of the layout. The caller keeps `mapping`
    alive while it uses the descriptor (it holds addresses into it)."""
    blobs, offsets, types, ends, ws = [np.zeros(pad, np.uint8)], [], [], [], []
    at, start = pad, 0
    for type_, rows in rows_by_type:
        n, rb = rows.shape
        seg_order = np.arange(n) if order is None else order
        offsets.append(at + seg_order * rb)
        blobs.append(rows.reshape(-1))
        ws.append(ops.dequantize_gguf(rows, type_, k)[torch.from_numpy(seg_order)])
        at += n * rb
        start += n
        types.append(type_)
        ends.append(start)
    mapping = torch.from_numpy(np.concatenate(blobs))
    desc = ops.gguf_matrix(mapping, torch.from_numpy(np.concatenate(offsets)), types, ends, k)
    return desc, mapping, torch.cat(ws)


def k_for(type_: str, blocks: int) -> int:
    return max(block_of(type_), 16) * blocks


@pytest.mark.parametrize("type_", KERNEL_TYPES)
def test_weights_are_the_dequantized_values_bit_for_bit(isa, type_):
    k = k_for(type_, 3)
    rows = random_rows(type_, 21, k, seed=1)
    order = np.random.default_rng(0).permutation(21)
    desc, mapping, w = matrix([(type_, rows)], k, order=order)
    for m in (1, 5, k):  # the few-rows and the many-rows loops
        eye = torch.eye(k)[:m].contiguous()
        assert torch.equal(ops.panel_linear(eye, desc), w[:, :m].T), m
    assert ops.panel_shape(desc) == (21, k)


@pytest.mark.parametrize("type_", KERNEL_TYPES)
def test_products_match_fp64_and_are_the_same_bits_in_every_batch(isa, type_):
    k = k_for(type_, 5 if block_of(type_) < 256 else 2)
    rows = random_rows(type_, 37, k, seed=2)
    desc, mapping, w = matrix([(type_, rows)], k)
    x = torch.randn(23, k)
    bias = torch.randn(37)
    y = ops.panel_linear(x, desc, bias)
    ref = x.double() @ w.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - ref).abs() <= RTOL * scale + 1e-30).all()
    for rows_in_step in (1, 2, 3, 4, 5, 7, 8, 9, 16):
        for first in (0, 23 - rows_in_step):
            part = ops.panel_linear(x[first:first + rows_in_step].contiguous(), desc, bias)
            assert torch.equal(part, y[first:first + rows_in_step]), (rows_in_step, first)


def test_avx2_gives_the_avx512_bits():
    if "avx512" not in ops.available_cpu_isas() or "avx2" not in ops.available_cpu_isas():
        pytest.skip("needs a CPU with AVX-512")
    before = ops.config().cpu_isa
    try:
        for type_ in ("Q4_K", "Q6_K", "Q4_1", "Q8_0", "F16", "IQ4_XS"):
            k = k_for(type_, 4 if block_of(type_) < 256 else 2)
            desc, mapping, _ = matrix([(type_, random_rows(type_, 40, k, seed=3))], k)
            x = torch.randn(20, k)
            out = {}
            for isa in ("avx512", "avx2"):
                ops.configure(cpu_isa=isa)
                out[isa] = [ops.panel_linear(x[:m].contiguous(), desc) for m in (1, 2, 20)]
            assert all(torch.equal(a, b) for a, b in zip(out["avx512"], out["avx2"])), type_
    finally:
        ops.configure(cpu_isa=before)


def test_fused_segments_of_mixed_types():
    """q | k | v as a Q4_K_M file lays them out: Q4_K, Q4_K, Q6_K rows in one weight."""
    k = 512
    parts = [("Q4_K", random_rows("Q4_K", 48, k, 4)), ("Q4_K", random_rows("Q4_K", 16, k, 5)),
             ("Q6_K", random_rows("Q6_K", 16, k, 6))]
    desc, mapping, w = matrix(parts, k)
    x = torch.randn(12, k)
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    for m in (1, 12):
        y = ops.panel_linear(x[:m].contiguous(), desc)
        assert ((y.double() - ref[:m]).abs() <= RTOL * scale[:m]).all(), m


@pytest.mark.parametrize("type_", ["Q8_0", "Q4_1", "F16"])
def test_an_uneven_last_chunk_keeps_the_one_row_bits(isa, type_):
    """K = 288 is cut into chunks of 160 and 128 (or 144 and 144) k: the many-rows loop's copy of
    x by chunks must put every row's k where the micro-kernel reads them."""
    k = 288
    desc, mapping, w = matrix([(type_, random_rows(type_, 19, k, seed=8))], k)
    x = torch.randn(30, k)
    y = ops.panel_linear(x, desc)
    scale = x.double().abs() @ w.double().abs().T
    assert ((y.double() - x.double() @ w.double().T).abs() <= RTOL * scale + 1e-30).all()
    for m in range(30):
        assert torch.equal(ops.panel_linear(x[m:m + 1].contiguous(), desc), y[m:m + 1]), m


def test_a_step_of_more_than_256_rows_runs_in_row_blocks_with_the_same_bits(isa):
    """Steps of over 256 rows run in passes of 256 (the copy of x stays bounded); each row and
    its bias land where one row alone puts them."""
    k = 512
    desc, mapping, _ = matrix([("Q4_K", random_rows("Q4_K", 24, k, seed=9))], k)
    x = torch.randn(300, k)
    bias = torch.randn(24)
    y = ops.panel_linear(x, desc, bias)
    for m in (0, 1, 255, 256, 257, 299):
        assert torch.equal(ops.panel_linear(x[m:m + 1].contiguous(), desc, bias), y[m:m + 1]), m
    assert torch.equal(ops.panel_linear(x[250:290].contiguous(), desc, bias), y[250:290])


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_bits(threads):
    k = 2048
    desc, mapping, _ = matrix([("Q4_K", random_rows("Q4_K", 300, k, 7))], k)
    x = torch.randn(40, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [ops.panel_linear(x[:m].contiguous(), desc) for m in (1, 8, 40)]
        torch.set_num_threads(threads)
        got = [ops.panel_linear(x[:m].contiguous(), desc) for m in (1, 8, 40)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_bad_descriptors_and_inputs_are_refused():
    k = 64
    rows = random_rows("Q8_0", 4, k)
    mapping = torch.from_numpy(rows.reshape(-1).copy())
    offsets = torch.arange(4) * rows.shape[1]
    with pytest.raises(ValueError, match="no kernel for GGUF type Q1_X"):
        ops.gguf_matrix(mapping, offsets, ["Q1_X"], [4], k)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.gguf_matrix(mapping, offsets, ["Q8_0"], [4], 48)
    with pytest.raises(ValueError, match="lies outside base"):
        ops.gguf_matrix(mapping, offsets + 1, ["Q8_0"], [4], k)
    with pytest.raises(ValueError, match="last end"):
        ops.gguf_matrix(mapping, offsets, ["Q8_0"], [3], k)
    desc = ops.gguf_matrix(mapping, offsets, ["Q8_0"], [4], k)
    assert ops.is_gguf_matrix(desc) and not ops.is_gguf_matrix(torch.zeros(80, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K = 32"):
        ops.panel_linear(torch.randn(2, 32), desc)
    with pytest.raises(ValueError):
        ops.panel_linear(torch.randn(2, k, dtype=torch.float64), desc)
