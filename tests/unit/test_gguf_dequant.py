"""freetoken.ops.dequantize_gguf: the C++ kernel of every GGUF type gives the gguf package's
`dequantize` values bit for bit, on every ISA variant, threaded or not, on random blocks whose
fp16 scales run through zero, subnormals, negatives and the largest finite value."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import freetoken.ops as ops
from freetoken.ops.backend import _C

KERNEL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
# where each block keeps its fp16 scales (ggml-common.h)
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
                 "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
                 "IQ4_NL": [0], "IQ4_XS": [0]}

pytestmark = pytest.mark.skipif(not ops.gguf_dequantize_available("Q4_K"),
                                reason="needs freetoken._C")


def finite_halfs(rng: np.random.Generator, n: int) -> np.ndarray:
    """n fp16 bit patterns: any sign, exponents 0..30 (zero, subnormals, normals up to 65504)."""
    bits = rng.integers(0, 0x7C00, size=n, dtype=np.uint16)
    bits[: min(n, 4)] = [0x0000, 0x0001, 0x03FF, 0x7BFF][: min(n, 4)]  # 0, subnormals, max
    return bits | (rng.integers(0, 2, size=n, dtype=np.uint16) << 15)


def random_rows(type_: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8 of valid random `type_` rows of k values."""
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_]]
    if type_ == "F32":
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if type_ in ("F16", "BF16"):
        halfs = finite_halfs(rng, n * k) if type_ == "F16" else \
            rng.integers(0, 0x7F80, size=n * k, dtype=np.uint16)
        return halfs.reshape(n, k).view(np.uint8)
    blocks = rng.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[type_]:
        blocks[:, off:off + 2] = finite_halfs(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference(rows: np.ndarray, type_: str, k: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_]
    data = rows.view({"F32": np.float32, "F16": np.float16}.get(type_, np.uint8))
    out = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(-1, k))


@pytest.mark.parametrize("type_", KERNEL_TYPES)
@pytest.mark.parametrize("blocks_per_row, n", [(1, 1), (2, 3), (5, 7)])
def test_every_type_equals_the_gguf_package(isa, type_, blocks_per_row, n):
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_]][0]
    k = max(block, 32) * blocks_per_row
    rows = random_rows(type_, n, k, seed=blocks_per_row)
    got = ops.dequantize_gguf(rows, type_, k)
    want = reference(rows, type_, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, want), (got - want).abs().max()
    # the embedding's form: a uint8 tensor (its rows looked up from the file's mapping), taken
    # straight to the kernel; every other row too (not contiguous)
    table = torch.from_numpy(rows)
    assert torch.equal(ops.dequantize_gguf(table, type_, k), want)
    assert torch.equal(ops.dequantize_gguf(table[::2], type_, k), want[::2])


@pytest.mark.parametrize("type_", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS"])
def test_large_tensors_split_over_threads_alike(type_):
    """A tensor large enough for the thread pool: the same values with 1 and 2 threads."""
    k = 1024
    rows = random_rows(type_, 301, k, seed=9)
    want = reference(rows, type_, k)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(ops.dequantize_gguf(rows, type_, k), want), t
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_covers_the_listed_types():
    assert all(ops.gguf_dequantize_available(t) for t in KERNEL_TYPES)
    assert not ops.gguf_dequantize_available("IQ2_XXS")


def test_bad_rows_are_refused_with_the_reason():
    rows = random_rows("Q4_K", 2, 256)
    with pytest.raises(RuntimeError, match="multiple of 256 values, not 250"):
        ops.dequantize_gguf(rows, "Q4_K", 250)
    with pytest.raises(RuntimeError, match="is 288 bytes, not 144"):
        ops.dequantize_gguf(rows, "Q4_K", 512)
    with pytest.raises(RuntimeError, match="is 288 bytes, not 144"):
        ops.dequantize_gguf(torch.from_numpy(rows), "Q4_K", 512)
    with pytest.raises(RuntimeError, match="no kernel for GGUF type Q9_9"):
        _C.gguf_dequantize(torch.from_numpy(rows), "Q9_9", 256)


def test_types_without_a_kernel_go_through_the_gguf_package():
    """The twin: a type the kernel does not cover is the gguf package's own result."""
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    assert not ops.gguf_dequantize_available("IQ2_XXS")
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, size=(2, 66), dtype=np.uint8)
    rows[:, 0:2] = finite_halfs(rng, 2).view(np.uint8).reshape(-1, 2)
    assert torch.equal(ops.dequantize_gguf(rows, "IQ2_XXS", 256),
                       torch.from_numpy(gguf.quants.dequantize(rows, qtype)))
