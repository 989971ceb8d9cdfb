"""freetoken.ops: the extension (every CPU ISA it has, and CUDA where present) and the torch twin,
each against an fp64 reference: ids exactly (ties to the lower id), logprobs within 1e-5 for the
extension and 5e-5 for the twin (torch's fp32 logsumexp is ~3e-5 off fp64 at V = 152k).

The reference takes x = logit + bias in fp32, as the contract says, and does the rest in fp64.

One file for the top-k and sampling ops: their shared fp64 reference and fixtures.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import pytest
import torch
from cpu_variants import available_isas
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import freetoken.ops as ops
from freetoken.ops import topk
from freetoken.ops.backend import _C

NEG_INF = float("-inf")
HAS_EXT = _C is not None
HAS_CUDA = HAS_EXT and torch.cuda.is_available() and _C.cuda_compiled()


def _isas() -> list[str]:
    return available_isas() if HAS_EXT else []


ISAS = _isas()
BACKENDS = [f"ext-{i}" for i in ISAS] + ["torch"]


@pytest.fixture(params=BACKENDS)
def impl(request):
    """A callable with topk_logprobs' signature, plus its logprob tolerance."""
    name = request.param
    if name == "torch":
        def run(logits, k, allowed=None, logit_bias=None, full_lse=False):
            B, V = logits.shape
            a = topk._check_compact("allowed", allowed, B, V, logits.device, False)
            b = topk._check_compact("logit_bias", logit_bias, B, V, logits.device, True)
            return topk._topk_logprobs_torch(logits, k, a, b, full_lse)
        yield run, 5e-5
        return
    ops.configure(cpu_isa=name.removeprefix("ext-"))
    yield ops.topk_logprobs, 1e-5
    ops.configure()


# ---------------------------------------------------------------------------------------------
# helpers


def compact(lists):
    offsets = [0]
    flat = []
    for ids in lists:
        flat.extend(ids)
        offsets.append(len(flat))
    return (torch.tensor(offsets, dtype=torch.int32), torch.tensor(flat, dtype=torch.int32))


def compact_bias(dicts):
    offsets, ids, vals = [0], [], []
    for d in dicts:
        for t, v in d:
            ids.append(t)
            vals.append(v)
        offsets.append(len(ids))
    return (torch.tensor(offsets, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32),
            torch.tensor(vals, dtype=torch.float32))


def reference(logits, k, allowed_lists=None, bias_lists=None):
    """fp64 reference: (ids [B,k] int64, logprobs [B,k] fp64, lse [B] fp64)."""
    B, V = logits.shape
    x = logits.float().clone()
    if bias_lists is not None:
        dense = torch.zeros(B, V)
        for r, entries in enumerate(bias_lists):
            for t, v in entries:
                dense[r, t] += torch.tensor(v, dtype=torch.float32)
        x = x + dense
    x = x.double()
    ids = torch.full((B, k), -1, dtype=torch.int64)
    lps = torch.full((B, k), NEG_INF, dtype=torch.float64)
    lse = torch.empty(B, dtype=torch.float64)
    for r in range(B):
        if allowed_lists is not None and allowed_lists[r]:
            members = torch.tensor(sorted(set(allowed_lists[r])), dtype=torch.int64)
        else:
            members = torch.arange(V)
        xr = x[r, members]
        lse[r] = torch.logsumexp(xr, 0)
        order = torch.sort(xr, descending=True, stable=True).indices[:k]  # members are id-sorted
        n = order.numel()
        ids[r, :n] = members[order]
        lps[r, :n] = xr[order] - lse[r]
    return ids, lps, lse


def reference_full(logits, bias_lists=None):
    """fp64 reference of the unmasked lse: log sum over the whole row of exp(logit + bias)."""
    B, V = logits.shape
    x = logits.float().clone()
    for r, entries in enumerate(bias_lists or []):
        for t, v in entries:
            x[r, t] += torch.tensor(v, dtype=torch.float32)
    return torch.logsumexp(x.double(), -1)


def assert_full_matches(full, ref_full, tol):
    assert full.dtype == torch.float32 and full.shape == ref_full.shape
    err = (full.double() - ref_full).abs().max().item()
    assert err <= tol, err


def assert_matches(out, ref, tol):
    ids, lps, lse = out
    rids, rlps, rlse = ref
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(ids, rids), (ids, rids)
    fin = torch.isfinite(rlps)
    assert torch.equal(torch.isfinite(lps), fin)
    assert torch.all(lps[~fin] == NEG_INF)
    if fin.any():
        err = (lps.double()[fin] - rlps[fin]).abs().max().item()
        assert err <= tol, err
    err = (lse.double() - rlse).abs().max().item()
    assert err <= tol, err


def randn(B, V, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# topk_logprobs


@pytest.mark.parametrize("B,V", [(1, 111), (3, 111), (1, 49152), (5, 49152), (2, 151936)])
@pytest.mark.parametrize("k", [0, 1, 5, 64])
def test_dense_fp32(impl, B, V, k):
    run, tol = impl
    x = randn(B, V, seed=B * V + k)
    assert_matches(run(x, k), reference(x, k), tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [111, 49152])
def test_dense_half_types_have_ties(impl, dtype, V):
    run, tol = impl
    x = randn(3, V, dtype, scale=2.0, seed=7)
    assert_matches(run(x, 20), reference(x, 20), tol)


def test_large_logits_are_accurate(impl):
    run, tol = impl
    x = randn(2, 49152, seed=3) + 100.0
    assert_matches(run(x, 5), reference(x, 5), tol)


def test_ties_go_to_the_lower_id(impl):
    run, tol = impl
    x = torch.zeros(2, 3000)
    x[1, 2000:] = 1.0
    ids, lps, lse = run(x, 8)
    assert ids[0].tolist() == list(range(8))
    assert ids[1].tolist() == list(range(2000, 2008))
    assert_matches((ids, lps, lse), reference(x, 8), tol)


@pytest.mark.parametrize("V", [111, 49152, 151936])
def test_masked_sets(impl, V):
    run, tol = impl
    g = torch.Generator().manual_seed(V)
    sizes = [1, 2, 100, V // 16 - 1, V // 16, min(5000, V), V]
    lists = [torch.randperm(V, generator=g)[:n].tolist() for n in sizes]
    lists[2] = lists[2] + lists[2][:30]  # duplicates count once
    lists.append([])                     # an empty range: no mask on that row
    x = randn(len(lists), V, seed=V + 1)
    for k in (1, 20, 64):
        assert_matches(run(x, k, compact(lists)), reference(x, k, lists), tol)


def test_k_larger_than_the_set_pads(impl):
    run, tol = impl
    x = randn(3, 500, seed=5)
    lists = [[7], [3, 3, 9, 1], list(range(500))]
    ids, lps, lse = run(x, 6, compact(lists))
    assert ids[0].tolist() == [7, -1, -1, -1, -1, -1]
    assert abs(float(lps[0, 0])) <= 1e-6
    assert sorted(ids[1, :3].tolist()) == [1, 3, 9] and ids[1, 3:].tolist() == [-1, -1, -1]
    assert_matches((ids, lps, lse), reference(x, 6, lists), tol)
    p = torch.exp(lps[1, :3].double()).sum().item()
    assert abs(p - 1.0) < 1e-5  # renormalised over the allowed set


def test_k_larger_than_vocab(impl):
    run, tol = impl
    x = randn(2, 10, seed=9)
    ids, lps, lse = run(x, 16)
    assert (ids[:, 10:] == -1).all() and (lps[:, 10:] == NEG_INF).all()
    assert_matches((ids, lps, lse), reference(x, 16), tol)


@pytest.mark.parametrize("V", [111, 49152])
def test_logit_bias(impl, V):
    run, tol = impl
    x = randn(4, V, seed=11)
    bias = [[(5, 100.0), (6, -100.0)], [], [(V - 1, 3.5), (V - 1, 1.5), (0, -2.0)],
            [(t, 0.25) for t in range(0, V, 7)]]
    lists = [[], [], [V - 1, 0, 17], list(range(0, V, 3))]
    for k in (1, 5):
        assert_matches(run(x, k, None, compact_bias(bias)), reference(x, k, None, bias), tol)
        assert_matches(run(x, k, compact(lists), compact_bias(bias)),
                       reference(x, k, lists, bias), tol)
    ids, _, _ = run(x, 1, None, compact_bias(bias))
    assert int(ids[0, 0]) == 5


def test_minus_inf_logits(impl):
    run, tol = impl
    x = randn(3, 2000, seed=13)
    x[0, ::2] = NEG_INF
    x[1, :1500] = NEG_INF
    x[2, 10] = NEG_INF
    lists = [[], [], [10, 11, 12]]
    assert_matches(run(x, 64, compact(lists)), reference(x, 64, lists), tol)
    ids, lps, _ = run(x, 5, compact(lists))
    assert ids[2, 2].item() == 10 and lps[2, 2].item() == NEG_INF  # a member, ranked last
    assert ids[2, 3].item() == -1


@pytest.mark.parametrize("V", [200, 49152])
def test_nan_and_plus_inf_are_errors(impl, V):
    run, _ = impl
    x = randn(3, V, seed=17)
    x[1, V // 2] = float("nan")
    with pytest.raises(RuntimeError, match="row 1 has NaN"):
        run(x, 5)
    # NaN outside the row's allowed set is never read
    out = run(x, 5, compact([[], [1, 2], []]))
    assert out[0][1].tolist()[:2] == sorted([1, 2], key=lambda t: -float(x[1, t]))
    x[1, V // 2] = 0.0
    x[2, 3] = float("inf")
    with pytest.raises(RuntimeError, match="row 2 has a \\+inf"):
        run(x, 5)
    x[2, 3] = 0.0
    x[0, 7] = NEG_INF
    with pytest.raises(RuntimeError, match="row 0 has logit -inf for every token"):
        run(x, 5, compact([[7], [], []]))


def test_two_threads_match_one(impl):
    run, tol = impl
    x = randn(3, 151936, seed=19)
    lists = [[], list(range(0, 151936, 5)), []]
    bias = [[(100000, 9.0)], [], [(5, -1.0), (140000, 20.0)]]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, 20, compact(lists), compact_bias(bias))
        torch.set_num_threads(2)
        two = run(x, 20, compact(lists), compact_bias(bias))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], two[0])
    assert_matches(two, reference(x, 20, lists, bias), tol)


@pytest.mark.skipif(not HAS_EXT, reason="freetoken._C not built")
@pytest.mark.parametrize("V", [111, 49152, 151936])
def test_a_rows_results_do_not_depend_on_the_batch_or_threads(V):
    """Batch invariance (issue 23): a row's ids, logprobs and lse have the same bits alone, in
    batches of 2 to 16 rows (a batch's size changes how the threads share the rows) and at 1
    or 2 threads, dense, masked and with bias."""
    x = randn(16, V, seed=V)
    lists = [[] if r % 3 else list(range(r, V, 7)) for r in range(16)]
    bias = [[(r * 5 % V, 3.0)] if r % 2 else [] for r in range(16)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [ops.topk_logprobs(x[r:r + 1], 20, compact(lists[r:r + 1]),
                                   compact_bias(bias[r:r + 1])) for r in range(16)]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for B in (2, 5, 16):
                got = ops.topk_logprobs(x[:B], 20, compact(lists[:B]), compact_bias(bias[:B]))
                for r in range(B):
                    for a, b in zip(got, alone[r]):
                        assert torch.equal(a[r], b[0]), (V, threads, B, r)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("V", [111, 49152, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_lse_is_the_unmasked_lse(impl, V, dtype):
    # every plan: no set, a gathered short list, a masked dense set, with and without bias
    run, tol = impl
    g = torch.Generator().manual_seed(V + 3)
    lists = [[], [3, 3, 9], torch.randperm(V, generator=g)[:V // 8].tolist(), [],
             torch.randperm(V, generator=g)[:V // 20 + 1].tolist(), list(range(V))]
    bias = [[(1, 4.0)], [(9, -2.0), (V - 1, 30.0)], [(0, 5.0), (0, 1.0)], [], [], [(2, 1.5)]]
    x = randn(len(lists), V, dtype, seed=V)
    for k in (0, 1, 20):
        for b in (None, bias):
            cb = compact_bias(b) if b else None
            out = run(x, k, compact(lists), cb, full_lse=True)
            assert len(out) == 4
            assert_matches(out[:3], reference(x, k, lists, b), tol)
            assert_full_matches(out[3], reference_full(x, b), tol)
            assert out[3][0] == out[2][0] and out[3][3] == out[2][3]  # no set: full is lse
            assert bool((out[2] - out[3] <= 1e-6).all())              # the set's mass <= 1
    ids, lps, lse = run(x, 5, compact(lists))  # without full_lse: three outputs, as before
    assert_matches((ids, lps, lse), reference(x, 5, lists), tol)


def test_full_lse_two_threads_match_one(impl):
    run, tol = impl
    x = randn(3, 151936, seed=41)
    lists = [[7, 8], list(range(0, 151936, 5)), []]
    bias = [[(100000, 9.0)], [(3, 2.0)], []]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, 8, compact(lists), compact_bias(bias), full_lse=True)
        torch.set_num_threads(2)
        two = run(x, 8, compact(lists), compact_bias(bias), full_lse=True)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], two[0])
    assert_full_matches(two[3], reference_full(x, bias), tol)
    assert_full_matches(one[3], reference_full(x, bias), tol)


@pytest.mark.parametrize("V", [200, 49152])
def test_full_lse_outside_the_set_nan_and_inf(impl, V):
    # NaN / +inf outside the set are no error (the set is fine); they reach the full lse
    run, _ = impl
    x = randn(3, V, seed=43)
    x[0, V - 1] = float("nan")
    x[1, V - 1] = float("inf")
    x[2, V - 1] = NEG_INF
    out = run(x, 2, compact([[1, 2], list(range(V // 2)), [1]]), full_lse=True)
    assert math.isnan(out[3][0].item()) and out[3][1].item() == float("inf")
    assert math.isfinite(out[3][2].item()) and math.isfinite(out[2][0].item())


def test_noncontiguous_and_batch_of_zero():
    x = randn(4, 300, seed=21)[:, ::2]
    ids, lps, lse = ops.topk_logprobs(x, 3)
    assert_matches((ids, lps, lse), reference(x.contiguous(), 3), 1e-5)
    ids, lps, lse = ops.topk_logprobs(torch.zeros(0, 50), 4)
    assert ids.shape == (0, 4) and lse.shape == (0,)
    assert ops.topk_logprobs(torch.zeros(0, 50), 4, full_lse=True)[3].shape == (0,)


@pytest.mark.parametrize("bad,match", [
    (dict(k=65), "k must be"),
    (dict(k=-1), "k must be"),
    (dict(allowed=compact([[1], [300]])), r"ids\[1\] = 300 \(row 1\) is outside"),
    (dict(allowed=compact([[1], [-2]])), "outside the vocabulary"),
    (dict(allowed=(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))),
     "B\\+1 = 3 entries, got 2"),
    (dict(allowed=(torch.tensor([0, 2, 1], dtype=torch.int32),
                   torch.tensor([1], dtype=torch.int32))), "must not decrease"),
    (dict(allowed=(torch.tensor([0, 1, 3], dtype=torch.int32),
                   torch.tensor([1], dtype=torch.int32))), "from 0 to len"),
    (dict(logit_bias=compact_bias([[(1, float("nan"))], []])), "not finite"),
    (dict(logit_bias=compact_bias([[(1, 1.0)], [(999, 1.0)]])), "outside the vocabulary"),
])
@pytest.mark.parametrize("use_ext", [True, False] if HAS_EXT else [False])
def test_validation_errors(bad, match, use_ext, monkeypatch):
    x = randn(2, 300)
    kw = dict(k=3)
    kw.update(bad)
    real = topk._check_compact
    if not use_ext:  # the Python validator (twin, GPU tensors) must say the same words
        monkeypatch.setattr(topk, "_check_compact",
                            lambda *a, **k: real(*a, **k, use_ext=False))
    with pytest.raises(ValueError, match=match) as err:
        ops.topk_logprobs(x, **kw)
    if HAS_EXT and "k must" not in match:
        B, V = x.shape
        comp = bad.get("allowed") or bad.get("logit_bias")
        what = "allowed" if "allowed" in bad else "logit_bias"
        msgs = []
        for flag in (True, False):
            try:
                real(what, comp, B, V, x.device, what == "logit_bias", use_ext=flag)
            except ValueError as exc:
                msgs.append(str(exc))
        assert len(msgs) == 2 and msgs[0] == msgs[1] == str(err.value)


def test_validation_dtype():
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        ops.topk_logprobs(torch.zeros(2, 5, dtype=torch.float64), 1)


VALUES = st.sampled_from([NEG_INF, -3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 7.25])


@st.composite
def problems(draw):
    B = draw(st.integers(1, 5))
    V = draw(st.integers(1, 300))
    k = draw(st.integers(0, 12))
    rows = [draw(st.lists(VALUES, min_size=V, max_size=V)) for _ in range(B)]
    for row in rows:  # every row needs one finite logit (an all -inf set is an error)
        row[draw(st.integers(0, V - 1))] = draw(st.floats(-4, 4, width=32))
    x = torch.tensor(rows, dtype=torch.float32)
    lists, biases = [], []
    for r in range(B):
        kind = draw(st.sampled_from(["none", "small", "big"]))
        ids = []
        if kind != "none":
            n = draw(st.integers(1, 4)) if kind == "small" else draw(st.integers(1, V * 2))
            ids = [draw(st.integers(0, V - 1)) for _ in range(n)]
            finite = [t for t in ids if x[r, t] != NEG_INF]
            if not finite:
                x[r, ids[0]] = 1.0
        lists.append(ids)
        nb = draw(st.integers(0, 3))
        biases.append([(draw(st.integers(0, V - 1)), draw(st.sampled_from([-2.0, 0.5, 3.0])))
                       for _ in range(nb)])
    return x, k, lists, biases


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_property_against_reference(p):
    x, k, lists, biases = p
    ref = reference(x, k, lists, biases)
    a, b = compact(lists), compact_bias(biases)
    B, V = x.shape
    ca = topk._check_compact("allowed", a, B, V, x.device, False)
    cb = topk._check_compact("logit_bias", b, B, V, x.device, True)
    ref_full = reference_full(x, biases)
    twin = topk._topk_logprobs_torch(x, k, ca, cb, True)
    assert_matches(twin[:3], ref, 5e-5)
    assert_full_matches(twin[3], ref_full, 5e-5)
    for isa in ISAS:
        ops.configure(cpu_isa=isa)
        try:
            assert_matches(ops.topk_logprobs(x, k, a, b), ref, 1e-5)
            out = ops.topk_logprobs(x, k, a, b, full_lse=True)
            assert_matches(out[:3], ref, 1e-5)
            assert_full_matches(out[3], ref_full, 1e-5)
        finally:
            ops.configure()


# ---------------------------------------------------------------------------------------------
# backend choice


def test_backend_names():
    assert ops.backend() == ("ext-cpu" if HAS_EXT else "torch")
    assert ops.backend_for("cpu") == ops.backend()


@pytest.mark.parametrize("mode,expect", [("torch", "torch"), ("ext", "ext-cpu")])
def test_forced_backend(mode, expect):
    if mode == "ext" and not HAS_EXT:
        pytest.skip("extension not built")
    ops.configure(backend=mode)
    try:
        assert ops.backend() == expect
        assert ops.config().backend == mode
    finally:
        ops.configure()
    assert ops.backend() == ("ext-cpu" if HAS_EXT else "torch")


@pytest.mark.parametrize("bad,match", [
    (dict(backend="gpu"), "backend must be one of auto, ext, torch, got 'gpu'"),
    (dict(linear="fast"), "linear must be one of auto, gguf, panels, onednn, torch, got 'fast'"),
    (dict(cpu_isa="neon"), "cpu_isa must be one of auto, avx512, avx2, base, got 'neon'"),
    (dict(pool_poll_us=-1), "pool_poll_us must be an int >= 0, got -1"),
    (dict(pool_poll_us=1.5), "pool_poll_us must be an int >= 0, got 1.5"),
])
def test_configure_refuses_bad_values(bad, match):
    before = ops.config()
    with pytest.raises(ValueError, match=match):
        ops.configure(**bad)
    assert ops.config() == before


def test_configure_sets_every_switch():
    isa = (ops.available_cpu_isas() or ("auto",))[-1]
    try:
        ops.configure(linear="panels", cpu_isa=isa, pool_poll_us=0)
        assert ops.config() == ops.OpsConfig("auto", "panels", isa, 0)
        if HAS_EXT:
            assert ops.cpu_isa() == isa
    finally:
        ops.configure()
    assert ops.config() == ops.OpsConfig()


# ---------------------------------------------------------------------------------------------
# the process: the kernels' thread pool and the memory their calls free


def run_fresh(code: str) -> str:
    """`code`'s stdout, run in a fresh interpreter (a process's first pool call, its own heap)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(not HAS_EXT, reason="extension not built")
def test_a_processs_first_pool_call_runs_on_both_threads():
    """The pool's helper, spawned by a process's first 2-thread call, takes a task of that call:
    int8_peak_gops' two tasks (equal loops) run one on each thread, so over the call the helper's
    CPU time is about the caller's (it was 0: it took the call for one it had seen)."""
    if ops.int8_bound_loop() is None:
        pytest.skip("the portable int8 loop: no bound loop to time")
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc: no per-thread CPU times")
    code = """
import os, time
import freetoken.ops as ops
ops.set_int8_amx(False)  # the VNNI or AVX2 loop: a known time a round
iters, t0 = 2_000_000, time.perf_counter()
ops.int8_peak_gops(iters, 1)
iters = int(iters * 0.3 / (time.perf_counter() - t0))  # ~0.3 s a task
def ticks():  # CPU time of each thread
    return {int(t): sum(int(v) for v in open(f"/proc/self/task/{t}/stat").read()
                        .rsplit(")", 1)[1].split()[11:13]) for t in os.listdir("/proc/self/task")}
before = ticks()
ops.int8_peak_gops(iters, 2)
spent = {t: v - before.get(t, 0) for t, v in ticks().items()}
print(spent.pop(os.getpid()), max(spent.values()))
"""
    caller, helper = (int(v) for v in run_fresh(code).split())
    assert caller > 0 and helper >= 0.5 * caller, (caller, helper)


@pytest.mark.skipif(not HAS_EXT, reason="extension not built: no malloc policy is set")
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc policy")
def test_memory_a_call_frees_stays_in_the_process():
    """With freetoken.ops loaded, buffers of the kernels' sizes freed after a call are taken
    again without page faults: glibc's defaults gave 2-7 MB of them back to the kernel every
    round (512-1792 faults; an int8 linear's x copies and y: 1564 faults a call, 1.25x its
    time)."""
    code = """
import resource
import torch
import freetoken.ops
def call():  # a step's buffers: allocated, written, freed together
    bufs = [torch.ones(1 << 21) for _ in range(3)]
    del bufs
for _ in range(4):
    call()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    call()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 8)
"""
    assert float(run_fresh(code)) < 64  # a round whose 24 MB came back faulted would be 6144


# ---------------------------------------------------------------------------------------------
# sample_tokens


def sample(x, T=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, step=None, allowed=None,
           bias=None):
    B = x.shape[0]
    full = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    step = torch.arange(B, dtype=torch.int64) if step is None else step
    return ops.sample_tokens(x, allowed, bias, full(T, torch.float32), full(top_k, torch.int32),
                             full(top_p, torch.float32), full(min_p, torch.float32),
                             full(seed, torch.int64), step)


def test_greedy_is_the_top_id():
    x = randn(6, 3000, seed=23)
    x[5, :] = 0.0  # all tied: the lowest id
    lists = [[], [4, 9, 2000], [], [77], [], []]
    bias = [[(1234, 50.0)], [], [], [], [], []]
    ids, _, _ = ops.topk_logprobs(x, 1, compact(lists), compact_bias(bias))
    got = sample(x, T=0.0, allowed=compact(lists), bias=compact_bias(bias))
    assert got.tolist() == ids[:, 0].tolist()
    assert got[0].item() == 1234 and got[5].item() == 0


def test_seed_reproducible_and_step_varies():
    x = randn(1, 5000, scale=1.0, seed=29).expand(64, -1).contiguous()
    a = sample(x, seed=123)
    b = sample(x, seed=123)
    c = sample(x, seed=124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len(set(a.tolist())) > 20


def test_distribution_matches_probabilities():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, NEG_INF, 1.5])
    n = 20000
    x = logits.expand(n, -1).contiguous()
    for T in (1.0, 0.7):
        got = sample(x, T=T, seed=7)
        p = torch.softmax(logits.double() / T, 0)
        freq = torch.bincount(got, minlength=8).double() / n
        sd = torch.sqrt(p * (1 - p) / n)
        assert torch.all((freq - p).abs() <= 5 * sd + 1e-12), (freq, p)
        assert freq[6] == 0


def test_filters_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.9, 0.8, -2.0])
    x = logits.expand(4000, -1).contiguous()
    assert set(sample(x, top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logits.double(), 0)  # [0.47, 0.43, 0.064, ...]
    assert set(sample(x, top_p=0.5).tolist()) == {0, 1}
    assert set(sample(x, top_p=float(p[0]) * 0.99).tolist()) == {0}
    assert set(sample(x, min_p=0.13).tolist()) == {0, 1, 2}  # p/p_max: e^-2 = 0.135, e^-2.1
    got = sample(x, top_k=3, top_p=0.95)  # top_p over the top-3-renormalised mass
    assert set(got.tolist()) == {0, 1, 2}
    lists = [[2, 3, 5]] * 4000
    got = sample(x, allowed=compact(lists))
    assert set(got.tolist()) == {2, 3, 5}


def test_top_p_ties_go_to_the_lower_ids():
    x = torch.zeros(3000, 300)
    x[:, 200:] = -30.0  # 200 equal leaders: top_p = 0.499 is exactly ids 0..99
    assert set(sample(x, top_p=0.499).tolist()) <= set(range(100))
    assert len(set(sample(x, top_p=0.499).tolist())) > 90
    x = torch.zeros(2000, 100000)  # a nucleus of 30000 tokens: grows past the first topk(64)
    assert max(sample(x[:200], top_p=0.3).tolist()) < 30000


def test_sampling_errors():
    x = randn(2, 10)
    x[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="row 1 has NaN"):
        sample(x)
    with pytest.raises(ValueError, match="top_p"):
        sample(randn(2, 10), top_p=0.0)


def _splitmix_py(x):
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_gumbel_noise_is_the_documented_hash():
    g = 0x9E3779B97F4A7C15
    seeds = [0, 1, 2**62 + 12345, -5]
    steps = [0, 7, 2**40, 3]
    ids = [0, 151935, 42, 99]
    got = ops.gumbel_noise(torch.tensor(seeds), torch.tensor(steps), torch.tensor(ids))
    for i, (s, t, tok) in enumerate(zip(seeds, steps, ids)):
        s0 = _splitmix_py(_splitmix_py(s ^ g) + t)
        h = _splitmix_py(s0 + tok * g)
        u = ((h >> 40) + 0.5) / 2**24
        assert got[i].item() == pytest.approx(-math.log(-math.log(u)), rel=1e-15)


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU and a CUDA build)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and freetoken._C built with CUDA")
@pytest.mark.parametrize("V", [111, 49152, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(V, dtype):
    g = torch.Generator().manual_seed(V)
    B = 7
    x = randn(B, V, dtype, seed=31)
    lists = [[], [5], torch.randperm(V, generator=g)[:100].tolist() * 2,
             torch.randperm(V, generator=g)[: V // 8].tolist(), [], [1, 2, 3], list(range(V))]
    bias = [[(3, 5.0)], [], [(V - 1, 2.0), (V - 1, 1.0)], [], [(0, -1.0)], [], []]
    for k in (0, 1, 20, 64):
        ref = reference(x, k, lists, bias)
        out = ops.topk_logprobs(x.cuda(), k, compact(lists), compact_bias(bias))
        assert_matches(tuple(t.cpu() for t in out), ref, 1e-5)
        out = ops.topk_logprobs(x.cuda(), k, compact(lists), compact_bias(bias), full_lse=True)
        assert_matches(tuple(t.cpu() for t in out[:3]), ref, 1e-5)
        assert_full_matches(out[3].cpu(), reference_full(x, bias), 1e-5)
    for B, V in ((1, 151936), (128, 151936), (33, 49152)):
        x = randn(B, V, seed=B)
        assert_matches(tuple(t.cpu() for t in ops.topk_logprobs(x.cuda(), 64)),
                       reference(x, 64), 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and freetoken._C built with CUDA")
def test_cuda_errors_and_ties():
    x = torch.zeros(3, 5000)
    ids, _, _ = ops.topk_logprobs(x.cuda(), 10)
    assert ids.cpu()[0].tolist() == list(range(10))
    x[1, 77] = float("nan")
    with pytest.raises(RuntimeError, match="row 1 has NaN"):
        ops.topk_logprobs(x.cuda(), 3)
    x[1, 77] = float("inf")
    with pytest.raises(RuntimeError, match="row 1 has a \\+inf"):
        ops.topk_logprobs(x.cuda(), 3)
