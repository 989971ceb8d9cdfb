"""ops.int8_matrix + ops.panel_linear (csrc/linear/int8_linear.cpp): the int8 compute mode.
Held to a NumPy reference of the same arithmetic, bit for bit (integer sums are exact, and the fp32
steps are written out in their order), for every format it takes, on every ISA variant (the
AVX512-VNNI, the AVX2 and the portable loop), at odd sizes:
  * the repacked codes and scales give each weight's dequantized value exactly: a * (u - c) + b;
  * x's quantization: per block of 32, d = amax / 127 and q = rint(x * (127 / amax));
  * y = the reference's bits, whatever the row count, the rows beside a row, or the threads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_linear import block_of, matrix, random_rows

import freetoken.ops as ops

pytestmark = pytest.mark.skipif(not ops.int8_matrix_available("Q4_K"),
                                reason="needs freetoken._C")

INT8_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
              "IQ4_NL", "IQ4_XS")
GROUP = {"Q6_K": 16, "Q2_K": 16, "Q3_K": 16}  # weights a scale; 32 for the rest
MIN_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")  # w = a * u + b; the rest a * (u - c)


# summed in integer over a superblock of 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")


def quantize_ref(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (q int32 [M, K], d fp32 [M, K / 32]), in fp32 as the kernel does, per
    block of `block` values (a block of 256's d repeated for each of its 32s)."""
    blocks = x.reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float32)
    return q.reshape(x.shape), np.repeat(d, block // 32, axis=1)


def linear_ref(x: np.ndarray, u: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray,
               type_: str, sb=None, block: int = 32) -> np.ndarray:
    """The int8 linear's arithmetic (int8_linear.cpp's module comment): x quantized per `block`
    (256 when the matrix holds a K-quant); a K-quant a superblock at a time from its own numbers
    `sb` (int8_matrix_superblocks), the other formats a group at a time."""
    q, d = quantize_ref(x, block)
    m_rows, k = x.shape
    acc = np.zeros((m_rows, u.shape[0]), np.float32)
    if type_ in K_TYPES:
        sd, smin, sc, mn = sb
        g_size = GROUP.get(type_, 32)
        for s in range(k // 256):
            i = np.zeros((m_rows, u.shape[0]), np.int64)
            mins = np.zeros_like(i)
            for g in range(s * 256 // g_size, (s + 1) * 256 // g_size):
                ks = slice(g * g_size, (g + 1) * g_size)
                qs = q[:, ks].sum(axis=1)[:, None]
                p = q[:, ks] @ u[:, ks].astype(np.int64).T - qs * c[None, :]
                i += p * sc[None, :, g * g_size // 16]
                mins += qs * mn[None, :, g * g_size // 16]
            assert np.abs(i).max() < 2**31 and np.abs(mins).max() < 2**31
            dx = d[:, s * 8][:, None]
            t = (sd[None, :, s] * dx).astype(np.float32)
            acc = (acc + (i.astype(np.float32) * t).astype(np.float32)).astype(np.float32)
            if type_ in MIN_TYPES:
                t2 = (-smin[None, :, s] * dx).astype(np.float32)
                acc = (acc + (mins.astype(np.float32) * t2).astype(np.float32)).astype(np.float32)
        return acc
    g_size = 32
    for g in range(k // g_size):
        ks = slice(g * g_size, (g + 1) * g_size)
        s = q[:, ks].sum(axis=1)                                   # [M]
        p = q[:, ks] @ u[:, ks].astype(np.int32).T - np.outer(s, c)  # [M, N] exact int
        dx = d[:, g]                                               # [M]
        t = (a[None, :, g * 2] * dx[:, None]).astype(np.float32)
        acc = (acc + (p.astype(np.float32) * t).astype(np.float32)).astype(np.float32)
        if type_ in MIN_TYPES:
            xs = (dx * s.astype(np.float32)).astype(np.float32)
            acc = (acc + (b[None, :, g * 2] * xs[:, None]).astype(np.float32)
                   ).astype(np.float32)
    return acc


def reference(x: np.ndarray, weight, type_: str, rows=slice(None), block=None) -> np.ndarray:
    """linear_ref on rows `rows` of an int8 matrix, x quantized as the matrix asks."""
    u, a, b, c = (t[rows] for t in unpacked(weight))
    sb = [t.numpy()[rows] for t in ops.int8_matrix_superblocks(weight)]
    if block is None:
        block = 256 if type_ in K_TYPES else 32
    return linear_ref(x, u, a, b, c, type_, sb, block)


def varied_rows(m: int, k: int) -> torch.Tensor:
    """x [m, k] whose 32s differ in size by up to 100x (a 256 block's scale then differs from
    its 32s'), with a zero 32."""
    g = torch.Generator().manual_seed(m * k)
    sizes = torch.rand(m, k // 32, generator=g).pow(2).add(0.01)
    x = torch.randn(m, k, generator=g) * sizes.repeat_interleave(32, dim=1)
    x[0, 32:64] = 0
    return x


def unpacked(weight):
    return [t.numpy() for t in ops.int8_matrix_unpack(weight)]


def int8_matrix(parts, k, order=None):
    desc, mapping, w = matrix(parts, k, order=order)
    offsets, types, ends, start = [], [], [], 0
    del desc
    # The same rows as gguf_matrix got them: rebuild the offsets from `matrix`'s layout.
    at = 7
    for type_, rows in parts:
        n, rb = rows.shape
        seg_order = np.arange(n) if order is None else order
        offsets.append(at + seg_order * rb)
        at += n * rb
        start += n
        types.append(type_)
        ends.append(start)
    weight = ops.int8_matrix(mapping, torch.from_numpy(np.concatenate(offsets)), types, ends, k)
    return weight, w


def k_for(type_: str, blocks: int) -> int:
    return block_of(type_) * blocks


@pytest.mark.parametrize("type_", INT8_TYPES)
def test_codes_and_scales_are_the_dequantized_weights(type_):
    k = k_for(type_, 3)
    order = np.random.default_rng(0).permutation(21)
    weight, w = int8_matrix([(type_, random_rows(type_, 21, k, seed=1))], k, order=order)
    u, a, b, c = unpacked(weight)
    g = np.repeat(np.arange(k // 16), 16)
    w_int8 = (a[:, g] * (u.astype(np.float32) - c[:, None].astype(np.float32))
              ).astype(np.float32) + b[:, g]
    if type_ in MIN_TYPES:  # fl(a * u) + b, as the dequantization rounds
        w_int8 = (a[:, g] * u.astype(np.float32)).astype(np.float32) + b[:, g]
    np.testing.assert_array_equal(w_int8, w.numpy())
    assert ops.panel_shape(weight) == (21, k)
    # A K-quant's own numbers, which its superblock arithmetic reads, are those same scales.
    d, dmin, sc, mn = (t.numpy() for t in ops.int8_matrix_superblocks(weight))
    if type_ in K_TYPES:
        s = np.arange(k // 16) // 16
        np.testing.assert_array_equal(a, (d[:, s] * sc.astype(np.float32)).astype(np.float32))
        np.testing.assert_array_equal(b, -(dmin[:, s] * mn.astype(np.float32)).astype(np.float32))
        assert (sc != 0).any() and (type_ not in MIN_TYPES or (mn != 0).any())
    else:
        assert not d.any() and not sc.any()


@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantization(isa, block):
    x = torch.randn(5, 768) * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(256)
    x *= torch.tensor([1, .4, .2, .05, 1, .7, .3, .1]).repeat_interleave(32).repeat(3)
    x[1, 256:512] = 0  # an all-zero block: d = 0, q = 0
    x[2, 0] = 127.5 / 127 * x[2, :block].abs().max()  # rounding at the edge
    q, d = ops.int8_quantize_rows(x, block)
    q_ref, d_ref = quantize_ref(x.numpy(), block)
    np.testing.assert_array_equal(q.numpy().astype(np.int32), q_ref)
    np.testing.assert_array_equal(d.numpy(), d_ref)
    assert q.abs().max() <= 127 and q.abs().max() == 127
    with pytest.raises(ValueError, match="block is 32 or 256"):
        ops.int8_quantize_rows(x, 64)


@pytest.mark.parametrize("type_", INT8_TYPES)
def test_products_are_the_reference_bits_in_every_batch(isa, type_):
    k = k_for(type_, 5 if block_of(type_) < 256 else 2)
    weight, w = int8_matrix([(type_, random_rows(type_, 37, k, seed=2))], k)
    x = varied_rows(23, k)
    bias = torch.randn(37)
    y = ops.panel_linear(x, weight, bias)
    ref = reference(x.numpy(), weight, type_) + bias.numpy()
    np.testing.assert_array_equal(y.numpy(), ref)
    # The int8 error itself stays small against the exact product.
    exact = x.double() @ w.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T
    assert ((y.double() - exact).abs() <= 0.02 * scale + 1e-6).all()
    for rows_in_step in (1, 2, 3, 7, 8, 9, 12, 13, 16):
        for first in (0, 23 - rows_in_step):
            part = ops.panel_linear(x[first:first + rows_in_step].contiguous(), weight, bias)
            assert torch.equal(part, y[first:first + rows_in_step]), (rows_in_step, first)


@pytest.mark.parametrize("type_", K_TYPES)
def test_rows_that_share_l1_sets_are_the_reference_bits(isa, type_):
    """At K = 2048 and 4096 every int8 row's line falls in one or two L1 sets; steps of 9-12
    rows then read x from the tile copy (int8_linear.cpp): the same bits as the rows alone."""
    for k in (2048, 4096):
        weight, _ = int8_matrix([(type_, random_rows(type_, 19, k, seed=11))], k)
        x = varied_rows(12, k)
        for m in (9, 12):
            y = ops.panel_linear(x[:m].contiguous(), weight)
            np.testing.assert_array_equal(y.numpy(), reference(x[:m].numpy(), weight, type_))
            for row in (0, m - 1):
                one = ops.panel_linear(x[row:row + 1].contiguous(), weight)
                assert torch.equal(one[0], y[row]), (k, m, row)


# Where each format's fp16 scales lie in its block (set finite below; 0xFF bytes elsewhere).
FP16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
           "IQ4_NL": (0,), "IQ4_XS": (0,)}


def largest_codes(type_: str, k: int, seed: int):
    """21 rows of type_ whose every byte is 0xFF (Q8_0: 0x80, codes of -128; IQ4: 0x00, the
    table's -127 and IQ4_XS's scale -32) but the fp16 scales (2^-7): every code at its largest,
    and the K4 formats' integer scales (Q6_K's int8 scales are then -1, Q3_K's 31). Returns
    (rows, their blocks)."""
    rows = random_rows(type_, 21, k, seed=seed)
    blocks = rows.reshape(21, k // block_of(type_), -1)
    blocks[:] = 0x80 if type_ == "Q8_0" else 0x00 if type_.startswith("IQ4") else 0xFF
    for at in FP16_AT[type_]:
        blocks[:, :, at], blocks[:, :, at + 1] = 0x00, 0x20
    return rows, blocks


def unit_signs(m: int, k: int) -> torch.Tensor:
    """x quantized to +-127 everywhere: rows of +-1, and a row with both signs."""
    x = torch.ones(m, k)
    x[1::2] = -1
    x[4, : k // 4] = -1
    return x


@pytest.mark.parametrize("type_", INT8_TYPES)
def test_the_largest_sums_are_exact(isa, type_):
    """The integer sums at their bounds: every code at its largest (Q8_0: -128) against x
    quantized to +-127 everywhere, in every row count the loops tile (48 rows: where the CPU has
    AMX-INT8, its tiles, as signed codes less their offset for the 32-value formats without a
    min). The AVX2 loop sums several steps' pairs in int16 before widening them; this is where
    they would overflow."""
    k = k_for(type_, 8 if block_of(type_) < 256 else 2)
    rows, _ = largest_codes(type_, k, seed=9)
    weight, _ = int8_matrix([(type_, rows)], k)
    x = unit_signs(48, k)
    y = ops.panel_linear(x, weight)
    np.testing.assert_array_equal(y.numpy(), reference(x.numpy(), weight, type_))
    assert y.abs().min() > 0  # not a cancelled sum: the bounds were reached
    for m in (1, 2, 3, 12):
        assert torch.equal(ops.panel_linear(x[:m].contiguous(), weight), y[:m]), m


@pytest.mark.parametrize("type_", K_TYPES)
def test_the_largest_scaled_codes_are_exact(isa, type_):
    """The AMX loop multiplies a K-quant's codes by their integer scale before the tile products
    (a product in two byte planes, lo + 256 hi): every code at its largest against the largest
    scales of either sign (Q6_K: -128 and 127; Q3_K, IQ4_XS: -32 and 31), x at +-127, 48 rows
    (a pair of row tiles and one alone). The reference's bits, and the VNNI loop's."""
    k = 512
    rows, blocks = largest_codes(type_, k, seed=13)
    if type_ == "Q6_K":  # its 16 int8 scales at 192..207
        blocks[:, :, 192:208:2], blocks[:, :, 193:208:2] = 0x80, 0x7F
    if type_ == "Q3_K":  # 6-bit scales at 96..107: groups 0-7 63 (31), 8-15 0 (-32)
        blocks[:, :, 96:108] = 0x0F
    if type_ == "IQ4_XS":  # 6-bit scales at 2..7: even groups 0 (-32), odd 63 (31)
        blocks[:, :, 2:4], blocks[:, :, 4:8] = 0xCC, 0xF0
    weight, _ = int8_matrix([(type_, rows)], k)
    x = unit_signs(48, k)
    y = ops.panel_linear(x, weight)
    np.testing.assert_array_equal(y.numpy(), reference(x.numpy(), weight, type_))
    assert y.abs().min() > 0
    if ops.int8_amx_available():
        before = ops.set_int8_amx(False)
        try:
            assert torch.equal(ops.panel_linear(x, weight), y)
        finally:
            ops.set_int8_amx(before)


def test_fused_segments_of_mixed_types_and_odd_sizes():
    """q | k | v as a Q4_K_M file lays them out (Q4_K, Q4_K, Q6_K), segments not multiples of
    16 outputs; a legacy pair; and a K-quant beside a legacy format, where x is quantized per
    256 for both (the legacy one reads that block's d for each of its 32s)."""
    for parts, k, block in (([("Q4_K", random_rows("Q4_K", 40, 512, 4)),
                              ("Q4_K", random_rows("Q4_K", 9, 512, 5)),
                              ("Q6_K", random_rows("Q6_K", 17, 512, 6))], 512, 256),
                            ([("Q4_1", random_rows("Q4_1", 3, 96, 7)),
                              ("Q8_0", random_rows("Q8_0", 30, 96, 8))], 96, 32),
                            ([("Q5_K", random_rows("Q5_K", 20, 512, 11)),
                              ("Q8_0", random_rows("Q8_0", 5, 512, 12))], 512, 256)):
        weight, _ = int8_matrix(parts, k)
        x = varied_rows(11, k)
        y = ops.panel_linear(x, weight)
        start = 0
        for type_, rows in parts:
            n = rows.shape[0]
            ref = reference(x.numpy(), weight, type_, slice(start, start + n), block)
            np.testing.assert_array_equal(y[:, start:start + n].numpy(), ref)
            start += n


def test_vnni_avx2_and_portable_loops_agree():
    if not ops.int8_vnni_available() or "avx2" not in ops.available_cpu_isas():
        pytest.skip("needs a CPU with AVX512-VNNI")
    before = ops.config().cpu_isa
    try:
        for type_ in INT8_TYPES:
            k = k_for(type_, 4 if block_of(type_) < 256 else 2)
            weight, _ = int8_matrix([(type_, random_rows(type_, 40, k, seed=3))], k)
            x = torch.randn(20, k)
            out = {}
            for isa in ("avx512", "avx2", "base"):
                ops.configure(cpu_isa=isa)
                out[isa] = [ops.panel_linear(x[:m].contiguous(), weight) for m in (1, 9, 20)]
            for isa in ("avx2", "base"):
                assert all(torch.equal(p, q) for p, q in zip(out["avx512"], out[isa])), (type_,
                                                                                          isa)
    finally:
        ops.configure(cpu_isa=before)


def test_avx2_loop_with_and_without_avx_vnni_gives_the_same_bits():
    """AVX-VNNI's vpdpbusd steps in the 8-lane loop (one a row and half into int32 sums, a
    K-quant group's then times its scales) against vpmaddubsw's int16 pairs: the same integer
    sums, so the same bits, every format, every row count of a tile, a mixed fused matrix."""
    if "avx2" not in ops.available_cpu_isas():
        pytest.skip("needs a CPU with AVX2")
    before, allowed_before = ops.config().cpu_isa, ops.set_int8_avx_vnni(True)
    try:
        ops.configure(cpu_isa="avx2")
        if not ops.int8_avx_vnni_available():
            pytest.skip("needs a CPU with AVX-VNNI")
        cases = []
        for type_ in INT8_TYPES:
            k = k_for(type_, 6 if block_of(type_) < 256 else 3)
            cases.append((type_, int8_matrix([(type_, random_rows(type_, 40, k, seed=5))], k)[0],
                          k))
        k = 512
        mixed = [(t, random_rows(t, n, k, seed=6)) for t, n in
                 (("Q4_K", 24), ("Q6_K", 17), ("Q8_0", 9), ("Q5_K", 16))]
        cases.append(("mixed", int8_matrix(mixed, k)[0], k))
        for name, weight, k in cases:
            x = varied_rows(13, k)
            out = {}
            for allowed in (True, False):
                ops.set_int8_avx_vnni(allowed)
                # tiles of 4 rows, then the last 1, 2 or 3
                out[allowed] = [ops.panel_linear(x[:m].contiguous(), weight)
                                for m in (1, 2, 3, 6, 13)]
            assert all(torch.equal(p, q) for p, q in zip(out[True], out[False])), name
            assert all(torch.isfinite(p).all() for p in out[True]), name
    finally:
        ops.set_int8_avx_vnni(allowed_before)
        ops.configure(cpu_isa=before)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_bits(threads):
    k = 2048
    weight, _ = int8_matrix([("Q4_K", random_rows("Q4_K", 300, k, 9))], k)
    x = torch.randn(40, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [ops.panel_linear(x[:m].contiguous(), weight) for m in (1, 8, 40)]
        torch.set_num_threads(threads)
        got = [ops.panel_linear(x[:m].contiguous(), weight) for m in (1, 8, 40)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(p, q) for p, q in zip(want, got))


def test_non_finite_input_gives_nan_rows_and_bad_input_is_refused(isa):
    k = 64
    weight, _ = int8_matrix([("Q8_0", random_rows("Q8_0", 16, k, 10))], k)
    x = torch.randn(4, k)
    x[1, 5] = float("inf")
    x[2, 40] = float("nan")
    y = ops.panel_linear(x, weight)
    assert torch.isnan(y[1:3]).all() and torch.isfinite(y[[0, 3]]).all()
    with pytest.raises(ValueError, match="K = 32"):
        ops.panel_linear(torch.randn(2, 32), weight)
    base = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no int8 kernel for GGUF type F16"):
        ops.int8_matrix(base, torch.zeros(2, dtype=torch.int64), ["F16"], [2], 64)
    with pytest.raises(ValueError, match="outside base"):
        ops.int8_matrix(base, torch.tensor([0, 990]), ["Q8_0"], [2], 64)


def test_the_int8_bound_times_the_loop_in_use(isa):
    """The benchmarks' int8 bound (scripts/compute_bound.py) runs the instructions of the loop
    that this ISA variant runs, and none where the portable loop runs."""
    loop = ops.int8_bound_loop()
    if isa == "base":
        assert loop is None
        with pytest.raises(ValueError, match="portable int8 loop"):
            ops.int8_peak_gops(1000, 1)
        return
    vnni = isa == "avx512" and ops.int8_vnni_available()
    amx = vnni and ops.int8_amx_available()
    avx_vnni = not vnni and ops.int8_avx_vnni_available()
    assert loop == ("tdpbssd (AMX-INT8)" if amx else "vpdpbusd (AVX512-VNNI)" if vnni
                    else "vpdpbusd (AVX-VNNI)" if avx_vnni else "vpmaddubsw+vpaddw (AVX2)")
    assert ops.int8_peak_gops(20_000, 1) > 0
    # the bound follows the loop: the one below while the faster one is forbidden
    if avx_vnni:
        assert_bound_while_forbidden(ops.set_int8_avx_vnni, "vpmaddubsw+vpaddw (AVX2)")
    if amx:
        assert_bound_while_forbidden(ops.set_int8_amx, "vpdpbusd (AVX512-VNNI)")


def assert_bound_while_forbidden(allow, loop: str) -> None:
    """With allow(False) (ops.set_int8_amx, ops.set_int8_avx_vnni), the bound times `loop`."""
    before = allow(False)
    try:
        assert ops.int8_bound_loop() == loop
        assert ops.int8_peak_gops(20_000, 1) > 0
    finally:
        allow(before)


def assert_amx_matches_vnni(cases, row_counts, threads):
    """For each (parts, k, type_): the AMX loop's y at each row count is the VNNI loop's, bit for
    bit, with a bias, on `threads` threads; and at the last (largest) count the reference's
    (where type_ names the matrix's one format)."""
    before, threads_before = ops.set_int8_amx(True), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for parts, k, type_ in cases:
            weight, _ = int8_matrix(parts, k)
            n = sum(rows.shape[0] for _, rows in parts)
            x, bias = varied_rows(row_counts[-1], k), torch.randn(n)
            for m in row_counts:
                ops.set_int8_amx(True)
                amx = ops.panel_linear(x[:m].contiguous(), weight, bias)
                ops.set_int8_amx(False)
                vnni = ops.panel_linear(x[:m].contiguous(), weight, bias)
                assert torch.equal(amx, vnni), (parts[-1][0], m)
            if type_ is not None:
                ref = reference(x.numpy(), weight, type_) + bias.numpy()
                np.testing.assert_array_equal(amx.numpy(), ref)
    finally:
        ops.set_int8_amx(before)
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_and_vnni_loops_give_the_same_bits(threads):
    """Where the CPU has AMX-INT8, steps from 32 rows up take tile products; their integer
    sums (and a K-quant's scales in integer) and fp32 steps are the VNNI loop's, so every bit
    agrees, every format, whatever the row count (whole tiles of 16, a K-quant's pairs of them
    and one alone, and the rows after them: a K-quant's as a tile of their own, zeros past the
    last row; below 32 rows the VNNI loop), in a matrix beside a
    K-quant (x then quantized per 256), a K-quant's panels two at a time (and one alone: an
    odd count, a format's last), with a bias, on 1 or 2 threads; and both are the
    reference's bits."""
    if not ops.int8_amx_available():
        pytest.skip("needs a CPU with AMX-INT8")
    cases = [([(t, random_rows(t, 37, k_for(t, 7 if block_of(t) < 256 else 2), seed=20 + i))],
              k_for(t, 7 if block_of(t) < 256 else 2), t) for i, t in enumerate(INT8_TYPES)]
    cases.append(([("Q4_K", random_rows("Q4_K", 16, 512, 30)),
                   ("Q8_0", random_rows("Q8_0", 21, 512, 31))], 512, None))
    for i, t in enumerate(K_TYPES):  # 5 superblocks: each one's codes widened while the last's
        cases.append(([(t, random_rows(t, 19, 1280, 40 + i))], 1280, t))  # products run
    # 41 panels: at 2 threads the pool's 32 tasks take one or two each (a pair, or one alone)
    cases.append(([("Q5_K", random_rows("Q5_K", 645, 512, 45))], 512, "Q5_K"))
    assert_amx_matches_vnni(cases, (16, 31, 32, 33, 35, 37, 41, 45, 47, 48, 64, 71), threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_loop_in_ranges_of_k_gives_the_same_bits(threads):
    """Past 1 MiB of x (rows x K), the AMX loop takes a K-quant matrix in ranges of K, each
    range's sums left in y for the next; the bits are the whole K's (the VNNI loop's and the
    reference's): every K-quant, a 32-value format beside one (it takes all of K at once), rows
    past the last whole tile, a bias, 1 or 2 threads."""
    if not ops.int8_amx_available():
        pytest.skip("needs a CPU with AMX-INT8")
    k = 16384  # 71 rows: 1.16 MB of x, two ranges; 140 rows three
    cases = [([(t, random_rows(t, 20, k, seed=50 + i))], k, t) for i, t in enumerate(K_TYPES)]
    cases.append(([("Q6_K", random_rows("Q6_K", 16, k, 60)),
                   ("Q8_0", random_rows("Q8_0", 5, k, 61))], k, None))
    assert_amx_matches_vnni(cases, (64, 71, 140), threads)


def test_amx_loop_gives_a_non_finite_row_nan_outputs():
    """In the AMX loop (x's tile copy and its steps' sums and scales, the last tile's rows past
    M zeros) a row with an infinity or a NaN gives NaN outputs, as in the VNNI loop, and every
    other row that loop's bits."""
    if not ops.int8_amx_available():
        pytest.skip("needs a CPU with AMX-INT8")
    k = 512
    weight, _ = int8_matrix([("Q4_K", random_rows("Q4_K", 20, k, 70))], k)
    x = varied_rows(37, k)
    x[3, 5], x[20, 300], x[36, 0] = float("inf"), float("nan"), float("-inf")
    before = ops.set_int8_amx(True)
    try:
        amx = ops.panel_linear(x, weight)
        ops.set_int8_amx(False)
        vnni = ops.panel_linear(x, weight)
    finally:
        ops.set_int8_amx(before)
    bad = [3, 20, 36]
    good = [i for i in range(37) if i not in bad]
    assert torch.isnan(amx[bad]).all() and torch.isnan(vnni[bad]).all()
    assert torch.equal(amx[good], vnni[good]) and torch.isfinite(amx[good]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_linear_is_silu_mul_then_the_linear_bit_for_bit(isa, threads):
    """ops.int8_silu_linear (the int8 decoder layer's down projection: silu(gate) * up made a row
    at a time into the quantization's input) gives panel_linear(silu_mul(gate_up)) bit for bit:
    every format, a K-quant beside a 32-value one, row counts on both sides of the AMX loop's 32
    and past a tile, a bias, gate_up as a view with a row stride past 2K, the AMX loop on and
    off, non-finite gates (NaN rows); and refuses a gate_up of the wrong width."""
    cases = [([(t, random_rows(t, 21, k_for(t, 4 if block_of(t) < 256 else 2), seed=80 + i))],
              k_for(t, 4 if block_of(t) < 256 else 2)) for i, t in enumerate(INT8_TYPES)]
    cases.append(([("Q6_K", random_rows("Q6_K", 16, 512, 90)),
                   ("Q8_0", random_rows("Q8_0", 5, 512, 91))], 512))
    amx_before, threads_before = ops.set_int8_amx(True), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for parts, k in cases:
            weight, _ = int8_matrix(parts, k)
            n = sum(rows.shape[0] for _, rows in parts)
            wide = torch.randn(50, 2 * k + 8) * 3
            wide[7, 3] = float("nan")  # a gate
            wide[9, k + 5] = float("inf")  # an up
            gate_up, bias = wide[:, :2 * k], torch.randn(n)
            for amx in (True, False):
                ops.set_int8_amx(amx)
                for m in (1, 8, 31, 33, 50):
                    want = ops.panel_linear(ops.silu_mul(gate_up[:m], k), weight, bias)
                    got = ops.int8_silu_linear(gate_up[:m], weight, bias)
                    finite = [i for i in range(m) if i not in (7, 9)]
                    assert torch.equal(got[finite], want[finite]), (parts[0][0], amx, m)
                    if m > 9:
                        assert torch.isnan(got[[7, 9]]).all() and torch.isnan(want[[7, 9]]).all()
    finally:
        ops.set_int8_amx(amx_before)
        torch.set_num_threads(threads_before)
    weight, _ = int8_matrix([("Q8_0", random_rows("Q8_0", 16, 64, 92))], 64)
    with pytest.raises(ValueError, match="K = 64"):
        ops.int8_silu_linear(torch.randn(2, 64), weight)
    with pytest.raises(ValueError, match="bias"):
        ops.int8_silu_linear(torch.randn(2, 128), weight, torch.randn(3))
