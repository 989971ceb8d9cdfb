"""freetoken.ops' fused elementwise ops (rms_norm, silu_mul, rope_): the extension (every CPU ISA
it has) and the torch twin (llama.py's code), each against an fp64 reference, and the extension
against the twin, on SmolLM2's shapes and odd ones (H 576 / 64; hd 64 / 128 / 80; T 1 / 8 / 224;
strided rows and q/k views into one qkv output; GQA 9:3).

What is asserted against the twin, and why:
  * rope_: bitwise, both dtypes. It is the same ops with the same roundings (the kernel rounds
    each product and the sum to the dtype, and is compiled without FMA contraction).
  * fp32 rms_norm, silu_mul: within 2e-6 relative. Only the order (and FMA) of the sum of squares
    and the exp implementation (Cephes vs Sleef, ~1 ulp) differ: a few fp32 ulps.
  * bf16 rms_norm, silu_mul: equal except on at most 0.1% of the elements, and those by one bf16
    ulp. The fp32 intermediate that torch rounds to bf16 (the normalised value; silu(gate)) may
    differ by an ulp or so, and lands on the other side of a bf16 rounding boundary about once in
    2^16 elements. (Measured here: none on these shapes.)
Against fp64: fp32 within 1e-5; bf16 within the roundings of the twin's ops (2^-6 relative);
rope_ within two roundings of its terms (see assert_rope_ref_close).
"""

from __future__ import annotations

import re

import pytest
import torch
from cpu_variants import available_isas

import freetoken.ops as ops
from freetoken.ops import elementwise
from freetoken.ops.backend import _C

torch.set_num_threads(1)

HAS_C = _C is not None  # the kernels are built
USES_EXT = ops.fused_elementwise_available(torch.empty(1))  # and chosen (ops.configure)
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]


def _isas() -> list[str]:
    return available_isas() if USES_EXT else []


IMPLS = [f"ext-{isa}" for isa in _isas()] + ["torch"]
needs_ext = pytest.mark.skipif(not USES_EXT, reason="the fused kernels are not in use")
needs_c = pytest.mark.skipif(not HAS_C, reason="freetoken._C is not built with these ops")


class Impl:
    """The three ops through one path: the public wrappers on the extension, or the twins."""

    def __init__(self, name: str):
        self.name = name
        self.ext = name != "torch"

    def rms_norm(self, x, w, eps, residual=None):
        if self.ext:
            assert ops.fused_elementwise_available(x)
            return ops.rms_norm(x, w, eps, residual)
        return elementwise._rms_norm_torch(x, w, eps, residual)

    def silu_mul(self, gate_up, inter):
        if self.ext:
            return ops.silu_mul(gate_up, inter)
        return elementwise._silu_mul_torch(gate_up, inter)

    def rope_(self, q, k, cos, sin):
        return (ops.rope_ if self.ext else elementwise._rope_torch_)(q, k, cos, sin)


@pytest.fixture(params=IMPLS)
def impl(request):
    name = request.param
    if name == "torch":
        yield Impl(name)
        return
    ops.configure(cpu_isa=name.removeprefix("ext-"))
    yield Impl(name)
    ops.configure()


TWIN = Impl("torch")


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def assert_twin_close(out: torch.Tensor, twin: torch.Tensor, rounding: torch.dtype):
    """out vs the twin's result, as the module docstring says; rounding = the dtype the last
    rounded intermediate had (bf16 for bf16 inputs, even when the output is fp32)."""
    assert out.dtype == twin.dtype and out.shape == twin.shape
    if rounding == torch.float32:
        torch.testing.assert_close(out, twin, rtol=2e-6, atol=1e-7, equal_nan=True)
        return
    a, b = out.double(), twin.double()
    differ = ~((a == b) | (a.isnan() & b.isnan()))
    assert differ.double().mean().item() <= 1e-3, f"{int(differ.sum())} of {a.numel()} differ"
    if differ.any():
        # one bf16 ulp of the rounded intermediate (2^-7 relative, at most), carried through
        rel = ((a - b).abs() / b.abs())[differ]
        assert rel.max().item() <= 2**-7, rel.max().item()


def assert_ref_close(out: torch.Tensor, ref: torch.Tensor, rounding: torch.dtype):
    if rounding == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# references (fp64)


def rms_norm_ref(x, w, eps):
    x64 = x.double()
    return w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def silu_mul_ref(gate_up, inter):
    g, u = gate_up.double().split(inter, dim=-1)
    return g * torch.sigmoid(g) * u


def assert_rope_ref_close(out, x, cos, sin):
    """out vs x * cos + rotate_half(x) * sin in fp64. Each product and the sum are rounded to
    the dtype, so the error is bounded by the terms' magnitudes, not the result's (the two
    products cancel where the result is small): |err| <= 2 u (|x cos| + |rot(x) sin|)."""
    x64, c, s = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    rot = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    ref = x64 * c + rot * s
    u = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-24
    bound = 2 * u * ((x64 * c).abs() + (rot * s).abs()) + 1e-30
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, excess


def rope_tables(T, hd, dtype, three_d=True):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    freqs = (torch.arange(T).float() * 7 + 3)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [T, hd]
    return (cos[:, None, :], sin[:, None, :]) if three_d else (cos, sin)


# ---------------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])  # -> fp32 out
@pytest.mark.parametrize("T", [1, 8, 224])
@pytest.mark.parametrize("H", [576, 64])
def test_rms_norm(impl, dtype, w_dtype, T, H):
    x = rand(T, H, dtype=dtype, seed=T + H, scale=3.0)
    w = rand(H, dtype=w_dtype, seed=1)
    out = impl.rms_norm(x, w, EPS)
    twin = TWIN.rms_norm(x, w, EPS)
    assert out.dtype == w_dtype  # torch's promotion of weight * normalised
    assert_twin_close(out, twin, dtype)
    assert_ref_close(out, rms_norm_ref(x, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 224])
@pytest.mark.parametrize("H", [576, 64])
def test_rms_norm_residual(impl, dtype, T, H):
    x = rand(T, H, dtype=dtype, seed=T, scale=2.0)
    res = rand(T, H, dtype=dtype, seed=H)
    w = rand(H, dtype=dtype, seed=2)
    x0, res0 = x.clone(), res.clone()
    out, s = impl.rms_norm(x, w, EPS, residual=res)
    assert s is res  # the documented contract: residual updated in place and returned
    assert torch.equal(x, x0)
    assert torch.equal(s, x0 + res0)  # torch's add: fp32 sum rounded to the dtype
    twin_out, twin_s = TWIN.rms_norm(x0, w, EPS, residual=res0.clone())
    assert torch.equal(s, twin_s)
    assert_twin_close(out, twin_out, dtype)
    assert_ref_close(out, rms_norm_ref(s, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(impl, dtype):
    # rows contiguous, row stride > H (e.g. a slice of a wider output)
    wide = rand(8, 576 + 40, dtype=dtype, seed=3)
    x = wide[:, 20:20 + 576]
    res_wide = rand(8, 700, dtype=dtype, seed=4)
    res = res_wide[:, :576]
    w = rand(576, dtype=dtype, seed=5)
    assert_twin_close(impl.rms_norm(x, w, EPS), TWIN.rms_norm(x.contiguous(), w, EPS), dtype)
    expect_s = x + res
    out, s = impl.rms_norm(x, w, EPS, residual=res)
    assert torch.equal(s, expect_s) and torch.equal(res_wide[:, :576], expect_s)
    assert_twin_close(out, TWIN.rms_norm(expect_s, w, EPS), dtype)


# ---------------------------------------------------------------------------------------------
# silu_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 224])
@pytest.mark.parametrize("inter", [1536, 64, 37])
def test_silu_mul(impl, dtype, T, inter):
    gate_up = rand(T, 2 * inter, dtype=dtype, seed=T * inter, scale=4.0)
    out = impl.silu_mul(gate_up, inter)
    assert out.shape == (T, inter) and out.dtype == dtype and out.is_contiguous()
    assert_twin_close(out, TWIN.silu_mul(gate_up, inter), dtype)
    assert_ref_close(out, silu_mul_ref(gate_up, inter), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_strided_rows(impl, dtype):
    wide = rand(8, 2 * 1536 + 16, dtype=dtype, seed=6)
    gate_up = wide[:, 8:8 + 2 * 1536]
    assert_twin_close(impl.silu_mul(gate_up, 1536), TWIN.silu_mul(gate_up.contiguous(), 1536),
                      dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_extremes(impl, dtype):
    # exp's range edges: overflow (silu -> -0), the finite tail near -88.5, underflow, inf, NaN
    # (-88.72283935546875 is the least float whose exp(-g) rounds to inf, the next one up is not)
    gates = [-1e4, -104.0, -100.0, -88.9, -88.72283935546875, -88.72283172607422, -88.5, -87.0,
             -30.0, -1e-3, 0.0, 1e-3, 30.0, 86.5, 87.0, 88.5, 100.0, 1e4, float("inf"),
             float("-inf"), float("nan")]
    g = torch.tensor(gates, dtype=dtype)
    gate_up = torch.cat((g, torch.full_like(g, 1.5)))[None, :]
    out = impl.silu_mul(gate_up, len(gates))
    twin = TWIN.silu_mul(gate_up, len(gates))
    # element by element (a fraction of 18 means nothing): an fp32 ulp or so, one bf16 ulp
    rtol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, twin, rtol=rtol, atol=0, equal_nan=True)
    num = ~twin.isnan()
    assert torch.equal(torch.signbit(out[num]), torch.signbit(twin[num]))  # -0.0 for -100


# ---------------------------------------------------------------------------------------------
# rope_


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 224])
@pytest.mark.parametrize("hd", [64, 128, 80])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("three_d", [True, False])
def test_rope_on_qkv_views(impl, dtype, T, hd, heads, three_d):
    nh, kvh = heads
    q_size, kv_size = nh * hd, kvh * hd
    qkv = rand(T, q_size + 2 * kv_size, dtype=dtype, seed=T + hd + nh, scale=2.0)
    cos, sin = rope_tables(T, hd, dtype, three_d)

    def views(t):
        return (t[:, :q_size].view(T, nh, hd),
                t[:, q_size:q_size + kv_size].view(T, kvh, hd))

    q0, k0 = (v.clone() for v in views(qkv))
    out = qkv.clone()
    assert impl.rope_(*views(out), cos, sin) is None
    twin = qkv.clone()
    TWIN.rope_(*views(twin), cos, sin)
    assert torch.equal(out, twin)  # bitwise, q and k; v untouched (checked next)
    assert torch.equal(out[:, q_size + kv_size:], qkv[:, q_size + kv_size:])
    c3, s3 = (cos, sin) if three_d else (cos[:, None], sin[:, None])
    q, k = views(out)
    assert_rope_ref_close(q, q0, c3, s3)
    assert_rope_ref_close(k, k0, c3, s3)


# ---------------------------------------------------------------------------------------------
# threads: above 32K elements the rows are split over threads; the result must not change


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [2048, 224, 57])  # a classify step's rows; ranges of 14 and 15
def test_parallel_matches_one_thread(dtype, T):
    x = rand(T, 576, dtype=dtype, seed=7)
    res = rand(T, 576, dtype=dtype, seed=8)
    w = rand(576, dtype=dtype, seed=9)
    gate_up = rand(min(T, 400), 3072, dtype=dtype, seed=10)
    qkv = rand(T, 960, dtype=dtype, seed=11)
    cos, sin = rope_tables(T, 64, dtype)

    def run():
        y = ops.rms_norm(x, w, EPS)
        y2, s = ops.rms_norm(x, w, EPS, residual=res.clone())
        act = ops.silu_mul(gate_up, 1536)
        t = qkv.clone()
        ops.rope_(t[:, :576].view(T, 9, 64), t[:, 576:768].view(T, 3, 64), cos, sin)
        return y, y2, s, act, t

    one = run()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert_twin_close(one[3], elementwise._silu_mul_torch(gate_up, 1536), dtype)


# ---------------------------------------------------------------------------------------------
# bad inputs raise (the extension checks; Python passes them through)


def _bad_cases():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    xb = x.bfloat16()
    gu = torch.randn(4, 128)
    qkv = torch.randn(4, 5 * 16)
    q, k = qkv[:, :48].view(4, 3, 16), qkv[:, 48:64].view(4, 1, 16)
    cos, sin = rope_tables(4, 16, torch.float32)
    norm, add = _C.rms_norm, _C.add_rms_norm
    return {
        "weight size": (lambda: norm(x, torch.randn(63), EPS), "weight must be"),
        "weight dtype": (lambda: norm(x, w.half(), EPS), "weight must be float32"),
        "bf16 weight, fp32 x": (lambda: norm(x, w.bfloat16(), EPS), "weight must be float32"),
        "x 3-D": (lambda: norm(x[None], w, EPS), "must be 2-D"),
        "x fp16": (lambda: norm(x.half(), w.half(), EPS), "float32 or bfloat16"),
        "x rows": (lambda: norm(torch.randn(64, 4).t(), w, EPS), "contiguous rows"),
        "residual shape": (lambda: add(x, torch.randn(4, 32), w, EPS), "residual must have"),
        "residual dtype": (lambda: add(xb, x, w, EPS), "residual must have x's dtype"),
        "residual rows": (lambda: add(x, torch.randn(64, 4).t(), w, EPS), "contiguous rows"),
        "intermediate": (lambda: _C.silu_mul(gu, 63), "gate_up must be"),
        "gate_up rows": (lambda: _C.silu_mul(torch.randn(128, 4).t(), 64), "contiguous"),
        "gate_up 1-D": (lambda: _C.silu_mul(gu[0], 64), "must be 2-D"),
        "odd head_dim": (lambda: _C.rope_(torch.randn(4, 3, 15), torch.randn(4, 1, 15),
                                              cos[..., :15], sin[..., :15]), "even"),
        "q stride(2)": (lambda: _C.rope_(torch.randn(4, 16, 3).transpose(1, 2), k, cos, sin),
                        "stride(2) == 1"),
        "q stride(1)": (lambda: _C.rope_(torch.randn(4, 3, 32)[..., :16], k, cos, sin),
                        "stride(1) == head_dim"),
        "k dtype": (lambda: _C.rope_(q, k.bfloat16(), cos, sin), "k must have q's dtype"),
        "k tokens": (lambda: _C.rope_(q, k[:3], cos, sin), "k must be"),
        "cos shape": (lambda: _C.rope_(q, k, cos[:3], sin), "cos must be"),
        "cos dtype": (lambda: _C.rope_(q, k, cos.bfloat16(), sin), "cos must have q's dtype"),
        "sin heads": (lambda: _C.rope_(q, k, cos, sin.expand(4, 3, 16)), "sin must be"),
    }


@needs_c
@pytest.mark.parametrize("case", sorted(_bad_cases()) if HAS_C else [])
def test_bad_inputs_raise(case):
    fn, match = _bad_cases()[case]
    with pytest.raises(RuntimeError, match=re.escape(match)):
        fn()


# ---------------------------------------------------------------------------------------------
# backend choice


def test_available_dtypes():
    for dtype in DTYPES:
        assert ops.fused_elementwise_available(torch.empty(1, dtype=dtype)) == USES_EXT
    assert not ops.fused_elementwise_available(torch.empty(1, dtype=torch.float16))
    assert not ops.fused_elementwise_available(torch.empty(1, dtype=torch.float64))


def test_fp16_takes_the_twin():
    x = rand(8, 64, dtype=torch.float16, seed=12)
    w = rand(64, dtype=torch.float16, seed=13)
    assert torch.equal(ops.rms_norm(x, w, EPS), elementwise._rms_norm_torch(x, w, EPS))


def test_forced_torch_uses_the_twin():
    x, w = torch.randn(8, 64), torch.randn(64)
    ops.configure(backend="torch")
    try:
        assert not ops.fused_elementwise_available(x)
        assert torch.equal(ops.rms_norm(x, w, 1e-5), elementwise._rms_norm_torch(x, w, 1e-5))
    finally:
        ops.configure()
