"""ops.panel_linear (csrc/linear/): x @ W^T (+ bias) over W packed once into panels, held
to an fp64 reference on every ISA variant, with N and K tails, any M, both thread paths, and the
errors for bad inputs."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from freetoken import ops
from freetoken.ops.backend import _C

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not ops.panel_linear_available(torch.empty(1)),
                                reason="freetoken._C with panel_linear not built")

# Each output is a sum of K fp32 products. With u = 2^-24, the worst-case bound is about
# K * u * sum|x_k w_k| (1.8e-4 relative at K = 3072); the kernel's running sums measure less.
# Asserted: |y - ref| <= RTOL * (|x| @ |W|^T + |b|), element by element.
RTOL = 1e-5

TAILS = [1, 15, 17, 576, 960, 1536, 3072]  # N and K: one line, under/over a 16-wide panel, model




def _case(M: int, N: int, K: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + M * 7919 + N * 31 + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


def _check(x, w, b, y):
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    scale = x64.abs() @ w64.abs().T
    if b is not None:
        ref = ref + b.double()
        scale = scale + b.double().abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    bad = err > RTOL * scale
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        ratio = float((err / scale.clamp_min(1e-300)).max())
        pytest.fail(f"y[{i}, {j}] = {float(y[i, j])}, ref {float(ref[i, j])} "
                    f"(worst err / scale {ratio:.2e}, allowed {RTOL})")


@pytest.mark.parametrize("bias", [False, True])
def test_every_m_up_to_20_and_tails(isa, bias):
    for M in range(1, 21):
        for N, K in [(1, 1), (15, 17), (17, 15), (33, 576), (16, 1536), (49, 3)]:
            x, w, b = _case(M, N, K, bias)
            _check(x, w, b, ops.panel_linear(x, ops.pack_panels(w), b))


@pytest.mark.parametrize("M", [1, 5, 17])
def test_n_and_k_tails(isa, M):
    for N in TAILS:
        for K in TAILS:
            x, w, b = _case(M, N, K, bias=(N + K) % 2 == 0)
            _check(x, w, b, ops.panel_linear(x, ops.pack_panels(w), b))


@pytest.mark.parametrize("M", [1, 2, 8, 16, 64, 224])
@pytest.mark.parametrize("N,K", [(960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_model_shapes(M, N, K):
    x, w, b = _case(M, N, K, bias=M % 2 == 1)
    _check(x, w, b, ops.panel_linear(x, ops.pack_panels(w), b))


def test_lm_head_shape():
    x, w, _ = _case(3, 49152, 576, bias=False)
    _check(x, w, None, ops.panel_linear(x, ops.pack_panels(w)))


@pytest.mark.parametrize("M,N,K", [(1, 8192, 1536), (8, 3072, 576), (224, 3072, 576),
                                   (37, 1000, 333), (57, 200, 1000)])
def test_two_threads_equal_one(M, N, K):
    """The helper threads take whole panels (and whole row chunks of x's transpose: 57 x 1000
    splits it, uneven chunks, a K tail), so the split changes no sum: bitwise equal."""
    x, w, b = _case(M, N, K, bias=True)
    p = ops.pack_panels(w)
    one = ops.panel_linear(x, p, b)
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            assert torch.equal(ops.panel_linear(x, p, b), one)
    finally:
        torch.set_num_threads(1)
    _check(x, w, b, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(33, 17), (1000, 333), (960, 576)])
def test_a_rows_result_does_not_depend_on_the_other_rows(isa, dtype, N, K):
    """Batch invariance (issue 23): every output is one running sum over k, so a row's bits are
    the same alone, beside 1..39 others (every row tile, a single panel, groups of 2 to 8 panels,
    pairs, odd panels left over: 33 and 1000 columns are 3 and 63 panels), at 1 or 2 threads,
    on every ISA."""
    x, w, b = _case(40, N, K, bias=True)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    p = ops.pack_panels(w)
    alone = torch.cat([ops.panel_linear(x[r:r + 1].contiguous(), p, b) for r in range(40)])
    for M in [*range(2, 21), 29, 37, 40]:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                y = ops.panel_linear(x[:M].contiguous(), p, b)
            finally:
                torch.set_num_threads(1)
            assert torch.equal(y, alone[:M]), (M, threads)
    if dtype == torch.float32:
        _check(x, w, b, alone)


def test_packed_layout_and_header():
    N, K = 35, 7
    w = torch.randn(N, K)
    p = ops.pack_panels(w)
    P = 3  # ceil(35 / 16)
    assert p.dtype == torch.float32 and p.dim() == 1 and p.numel() == 16 + P * K * 16
    header = p[:16].view(torch.int32).tolist()
    assert header[:6] == [0x4C505446, 1, N, K, 16, P] and header[6:] == [0] * 10
    assert ops.panel_shape(p) == (N, K)
    padded = torch.cat([w, torch.zeros(P * 16 - N, K)])                    # [48, K]
    want = padded.view(P, 16, K).transpose(1, 2)                           # [P, K, 16]
    assert torch.equal(p[16:].view(P, K, 16), want)
    # the header travels with the data: a clone, a parameter and a saved copy still work
    x = torch.randn(4, K)
    ref = ops.panel_linear(x, p)
    assert torch.equal(ops.panel_linear(x, p.clone()), ref)
    assert torch.equal(ops.panel_linear(x, torch.nn.Parameter(p, requires_grad=False)), ref)
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    assert torch.equal(ops.panel_linear(x, torch.load(buf)), ref)


def test_leading_dims_and_empty_rows():
    w = torch.randn(20, 9)
    p = ops.pack_panels(w)
    x = torch.randn(2, 3, 9)
    y = ops.panel_linear(x, p)
    assert y.shape == (2, 3, 20)
    _check(x.view(6, 9), w, None, y.view(6, 20))
    assert ops.panel_linear(torch.empty(0, 9), p).shape == (0, 20)


def test_bad_inputs_raise():
    w = torch.randn(20, 9)
    p = ops.pack_panels(w)
    x = torch.randn(3, 9)
    with pytest.raises(ValueError, match="of the weight's dtype"):
        ops.panel_linear(x.double(), p)
    with pytest.raises(ValueError, match="of the weight's dtype"):
        ops.panel_linear(x.bfloat16(), p)
    with pytest.raises(ValueError, match="of the weight's dtype"):
        ops.panel_linear(x, ops.pack_panels(w.bfloat16()))
    with pytest.raises(ValueError, match="K = 8, the packed weight has K = 9"):
        ops.panel_linear(torch.randn(3, 8), p)
    with pytest.raises(ValueError, match="contiguous"):
        ops.panel_linear(torch.randn(3, 18)[:, ::2], p)
    with pytest.raises(ValueError, match="contiguous"):
        ops.panel_linear(torch.randn(9, 3).T, p)
    with pytest.raises(ValueError, match="bias"):
        ops.panel_linear(x, p, torch.randn(19))
    with pytest.raises(ValueError, match="bias"):
        ops.panel_linear(x, p, torch.randn(20).double())
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        ops.pack_panels(w.double())
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        ops.pack_panels(torch.randn(20))
    with pytest.raises(ValueError, match="empty"):
        ops.pack_panels(torch.randn(0, 9))
    # a tensor that is not a pack (no header), a truncated pack, a weight passed as is
    with pytest.raises(ValueError, match="panel header"):
        ops.panel_linear(x, torch.randn(p.numel()))
    with pytest.raises(ValueError, match="does not match its size"):
        ops.panel_linear(x, p[:-16].clone())
    with pytest.raises(ValueError, match="1-D CPU tensor from pack_panels"):
        ops.panel_linear(x, w)
    with pytest.raises(ValueError, match="CPU tensor"):
        ops.panel_linear([[1.0] * 9], p)
    # a bf16 pack relabelled as fp32 (its header names bf16)
    pb = ops.pack_panels(w.bfloat16())
    with pytest.raises(ValueError, match="another format"):
        ops.panel_linear(x, pb.view(torch.int16).view(torch.float32)[:p.numel()].clone())
    with pytest.raises(ValueError, match="contiguous"):
        ops.panel_linear(torch.randn(2, 3, 18)[..., ::2], p)
    # the C++ checks stand on their own too (what a direct _C caller gets)
    with pytest.raises(RuntimeError, match="contiguous"):
        _C.panel_linear(torch.randn(3, 18)[:, ::2], p)
    with pytest.raises(RuntimeError, match="K = 8"):
        _C.panel_linear(torch.randn(3, 8), p)


def test_without_extension_is_a_clear_error():
    """A pure-Python install (freetoken._C absent): no panels, and a clear error from each op."""
    code = """
import sys
sys.modules["freetoken._C"] = None  # the import fails, as without a build
import pytest, torch
import freetoken.ops as ops
assert ops.backend() == "torch" and not ops.panel_linear_available(torch.empty(1))
with pytest.raises(RuntimeError, match="panel_linear needs freetoken._C"):
    ops.panel_linear(torch.randn(1, 4), torch.empty(80))
with pytest.raises(RuntimeError, match="pack_panels needs freetoken._C"):
    ops.pack_panels(torch.randn(4, 4))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_available_for_fp32_and_bf16_cpu():
    assert ops.panel_linear_available(torch.empty(2, 3))
    assert ops.panel_linear_available(torch.empty(2, 3, dtype=torch.bfloat16))
    assert not ops.panel_linear_available(torch.empty(2, 3, dtype=torch.float64))


# bf16: the weights and x are widened exactly, the sums are the fp32 kernel's (same order), y is
# rounded once. So y is bitwise the fp32 kernel's result on the same (bf16-valued) inputs, rounded
# to bf16; and that fp32 result is held to the fp64 reference.
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16, 17, 64])
@pytest.mark.parametrize("N, K", [(17, 15), (960, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_fp32_kernel_rounded_once(isa, M, N, K, bias):
    x, w, b = _case(M, N, K, bias, seed=5)
    xb, wb = x.bfloat16(), w.bfloat16()
    bb = None if b is None else b.bfloat16()
    y = ops.panel_linear(xb, ops.pack_panels(wb), bb)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    y32 = ops.panel_linear(xb.float(), ops.pack_panels(wb.float()),
                           None if bb is None else bb.float())
    _check(xb.float(), wb.float(), None if bb is None else bb.float(), y32)
    assert torch.equal(y, y32.bfloat16())


def test_bf16_pack_layout_and_shape():
    w = torch.randn(20, 9).bfloat16()
    p = ops.pack_panels(w)
    assert p.dtype == torch.bfloat16 and p.dim() == 1
    assert p.numel() == 32 + 2 * 9 * 16  # a 64-byte header, then 2 panels [9, 16]
    assert ops.panel_shape(p) == (20, 9)
    panel0 = p[32:32 + 9 * 16].view(9, 16)
    assert torch.equal(panel0, w[:16].T)
    assert torch.equal(p[32 + 9 * 16:].view(9, 16)[:, :4], w[16:].T)
    assert bool((p[32 + 9 * 16:].view(9, 16)[:, 4:] == 0).all())
