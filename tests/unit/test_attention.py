"""Paged attention against a dense fp64 reference, on random steps that mix decodes, prompts
behind a cached context, fresh prompts and chunks of unequal lengths: the torch path (padded
groups, the split when padding would waste too much, the fresh causal path), the decode kernel,
and the in-place kernel for every sequence (ops.paged_attention, csrc/attention/) on
every CPU ISA; sliding windows, GQA, fp32 / bf16 / fp16 pools, long contexts, bad inputs.

Tolerances: fp32 outputs within 1e-5 (absolute, outputs are O(1)) of the fp64 reference computed
on the same (rounded) inputs; bf16 / fp16 outputs within one rounding of it (2^-8 / 2^-11
relative, + 1e-5).

One file: every attention path is held to the same reference on the same random steps.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken import ops
from freetoken.engine.batch import ForwardBatch
from freetoken.model import attention
from freetoken.model.attention import build_attention_metadata, paged_attention

torch.set_num_threads(1)

BLOCK = 4
NUM_BLOCKS = 96
NH, KVH, HD = 6, 2, 8


def reference(q, k_ctx, v_ctx, positions, window):
    """q: [n, nh, hd] at absolute positions; k_ctx, v_ctx: [L, kvh, hd] -> [n, nh, hd] (fp64)."""
    group = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(group, dim=1)  # [L, nh, hd]
    v = v_ctx.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    kpos = torch.arange(k.shape[0])
    qpos = torch.tensor(positions)
    visible = kpos[None, :] <= qpos[:, None]
    if window is not None:
        visible &= kpos[None, :] > qpos[:, None] - window
    scores = scores.masked_fill(~visible[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_step(rng: random.Random, shapes: list[tuple[int, int]]):
    """shapes: (num_cached, num_new) per sequence -> a ForwardBatch, and each sequence's blocks."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
    for cached, new in shapes:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table)
        for p in range(cached, n):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        input_ids += [0] * new
        qsl.append(qsl[-1] + new)
        seq_lens.append(n)
    width = max(map(len, tables))
    block_tables = torch.zeros(len(shapes), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=torch.tensor([qsl[-1] - 1]),
    )
    return batch, tables


STEPS = {
    "decodes": [(5, 1), (17, 1), (1, 1), (30, 1)],
    "prompts behind a shared prefix, unequal tails": [(16, 7), (16, 3), (16, 12), (16, 1)],
    "fresh prompts, grouped": [(0, 9), (0, 11), (0, 8)],
    "fresh prompts, too uneven to pad": [(0, 40), (0, 2), (0, 3)],
    "one fresh prompt": [(0, 23)],
    "a chunk alone": [(12, 9)],
    "everything, padded together": [(9, 1), (14, 12), (20, 5), (3, 1), (17, 9), (18, 16)],
    "everything, split": [(9, 1), (0, 13), (20, 5), (3, 1), (0, 2), (31, 16)],
}


CPU = torch.device("cpu")
HAS_KERNEL = ops.paged_attention_available(CPU, torch.float32)  # built and chosen


ISAS = list(ops.available_cpu_isas()) if HAS_KERNEL else []
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="ops.paged_attention is not in use")
IMPLS = ["torch"] + [f"ext-{isa}" for isa in ISAS]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_matches_dense_reference(name, window, impl, monkeypatch):
    """ext-<isa>: one ops.paged_attention call for the step; torch: gather + SDPA."""
    if impl == "torch":
        monkeypatch.setattr(attention.ops, "paged_attention_available", lambda device, dt: False)
    else:
        ops.configure(cpu_isa=impl.removeprefix("ext-"))  # reset below
    rng = random.Random(sum(map(ord, name)) * 7 + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    batch, tables = random_step(rng, STEPS[name])
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KVH, HD)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KVH, HD)
    T = batch.num_tokens  # noqa: N806
    q, k, v = torch.randn(T, NH, HD), torch.randn(T, KVH, HD), torch.randn(T, KVH, HD)
    meta = build_attention_metadata(batch, BLOCK, window)
    assert (meta.kernel is not None) == impl.startswith("ext-")
    try:
        out = paged_attention(q, k, v, k_cache, v_cache, meta, HD**-0.5)
    finally:
        if ISAS:
            ops.configure()
    assert out.shape == (T, NH, HD)

    qsl = batch.query_start_loc
    for s, table in enumerate(tables):
        n = batch.seq_lens[s]
        ctx_slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        # the pool now holds this step's K/V at its slots, the older context around them
        k_ctx = k_cache.view(-1, KVH, HD)[ctx_slots]
        v_ctx = v_cache.view(-1, KVH, HD)[ctx_slots]
        rows = slice(qsl[s], qsl[s + 1])
        torch.testing.assert_close(k_ctx[n - (qsl[s + 1] - qsl[s]) :], k[rows])
        want = reference(q[rows], k_ctx, v_ctx, batch.positions[rows].tolist(), window)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=0)


def test_groups_are_what_the_docstring_says(monkeypatch):
    monkeypatch.setattr(attention.ops, "paged_attention_available", lambda device, dt: False)
    rng = random.Random(7)
    batch, _ = random_step(rng, STEPS["everything, padded together"])
    meta = build_attention_metadata(batch, BLOCK)
    # decodes in one group; the four multi-token sequences padded together (waste 1.8x)
    assert [g.num_seqs for g in meta.groups] == [2, 4] and meta.fresh == []
    assert [g.num_q for g in meta.groups] == [1, 16]
    batch, _ = random_step(rng, STEPS["everything, split"])
    meta = build_attention_metadata(batch, BLOCK)
    # padding 13, 5, 2 and 16 query rows over 47 keys would cost 2.9x: each alone
    assert [g.num_seqs for g in meta.groups] == [2, 1, 1] and len(meta.fresh) == 2
    batch, _ = random_step(rng, STEPS["fresh prompts, grouped"])
    assert [g.num_seqs for g in build_attention_metadata(batch, BLOCK).groups] == [3]
    batch, _ = random_step(rng, STEPS["fresh prompts, too uneven to pad"])
    meta = build_attention_metadata(batch, BLOCK)
    assert meta.groups == [] and len(meta.fresh) == 3
    batch, _ = random_step(rng, STEPS["fresh prompts, too uneven to pad"])
    meta = build_attention_metadata(batch, BLOCK, sliding_window=6)
    assert [g.num_seqs for g in meta.groups] == [1, 1, 1] and meta.fresh == []


# ---------------------------------------------------------------------------------------------
# ops.paged_attention directly: against the fp64 reference and the torch path


def kernel_reference(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, window):
    """Dense fp64 attention of every sequence's query rows over its context -> [T, nh, hd]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    _, bs, kvh, hd = k_cache.shape
    for s in range(len(seq_lens)):
        n, a, b = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        if a == b:
            continue
        slots = [int(block_tables[s, p // bs]) * bs + p % bs for p in range(n)]
        k_ctx = k_cache.reshape(-1, kvh, hd)[slots]
        v_ctx = v_cache.reshape(-1, kvh, hd)[slots]
        qs = q[a:b].double() * (scale / hd**-0.5)  # reference() scales by hd**-0.5
        out[a:b] = reference(qs, k_ctx, v_ctx, list(range(n - (b - a), n)), window)
    return out


def make_step(shapes, nh, kvh, hd, dtype, q_dtype=None, block=16, seed=0):
    """shapes: (num_cached, num_new) per sequence -> q and the kernel's tensors over a pool with
    shuffled blocks (non-contiguous tables) and a few spare blocks."""
    g = torch.Generator().manual_seed(seed)
    tables = [-(-(c + n) // block) for c, n in shapes]
    nb = sum(tables) + 5
    perm = torch.randperm(nb, generator=g)
    width = max(tables)
    block_tables = torch.zeros(len(shapes), width, dtype=torch.long)
    used = 0
    for s, count in enumerate(tables):
        block_tables[s, :count] = perm[used : used + count]
        used += count
    k_cache = torch.randn(nb, block, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(nb, block, kvh, hd, generator=g).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in shapes]).cumsum(0)
    q = torch.randn(int(qsl[-1]), nh, hd, generator=g).to(q_dtype or dtype)
    seq_lens = torch.tensor([c + n for c, n in shapes])
    return q, k_cache, v_cache, block_tables, seq_lens, qsl


def assert_close_to_reference(got, want, dtype):
    """fp32: 1e-5 absolute; bf16 / fp16 output: one rounding (half an ulp) + 1e-5."""
    assert got.dtype == dtype
    err = (got.double() - want).abs()
    half_ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bound = 1e-5 + half_ulp * want.abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


MIXED = [(176, 28), (0, 40), (99, 1), (0, 1), (300, 5), (3, 3), (16, 0), (17, 130), (15, 17)]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("nh,kvh,hd", [(9, 3, 64), (8, 8, 128), (8, 2, 72), (6, 2, 8),
                                       (12, 1, 16)])
@pytest.mark.parametrize("window", [None, 1, 37])
def test_kernel_matches_fp64(isa, nh, kvh, hd, window):
    """Sequences with 28 queries behind a cached prefix, fresh prompts (n_q == seq_len), decodes,
    a single-token prompt, no queries at all, chunks crossing block boundaries and partial last
    blocks; GQA 3, 1, 4, 6, 12; head_dim 64, 128 and three that are not a multiple of the
    vector width."""
    args = make_step(MIXED, nh, kvh, hd, torch.float32, seed=nh * hd)
    ops.configure(cpu_isa=isa)
    try:
        got = ops.paged_attention(*args, 0.3, window)
    finally:
        ops.configure()
    assert_close_to_reference(got, kernel_reference(*args, 0.3, window), torch.float32)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,q_dtype", [(torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float16)])
def test_kernel_half_precision_pools(isa, dtype, q_dtype):
    """bf16 / fp16 pools are widened exactly: with fp32 queries the result is the fp32 one on
    the pool's values (1e-5); with bf16 / fp16 queries it is that, rounded once."""
    args = make_step(MIXED, 9, 3, 64, dtype, q_dtype=q_dtype, seed=5)
    ops.configure(cpu_isa=isa)
    try:
        got = ops.paged_attention(*args, 0.125, 50)
    finally:
        ops.configure()
    assert_close_to_reference(got, kernel_reference(*args, 0.125, 50), q_dtype)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,kvh,hd", [(8, 2, 80), (16, 2, 64), (9, 3, 64)])
def test_kernel_decodes(isa, dtype, nh, kvh, hd):
    """One query token per sequence (the decode step; the former decode kernel's test): contexts
    1 to 300, groups of 4, 8 and 3 heads (tasks of at most 8 columns: the narrow shapes), a
    head_dim of 80 (a scalar tail), with and without a window; and two tokens of 8 heads."""
    shapes = [(0, 1), (16, 1), (299, 1), (63, 1), (128, 1), (40, 2)]
    args = make_step(shapes, nh, kvh, hd, dtype, seed=hd + nh)
    ops.configure(cpu_isa=isa)
    try:
        for window in (None, 50):
            got = ops.paged_attention(*args, 0.11, window)
            assert_close_to_reference(got, kernel_reference(*args, 0.11, window), dtype)
    finally:
        ops.configure()


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("hd", [37, 40, 64])
def test_kernel_decode_dot_products(isa, dtype, group, hd):
    """Tasks of one token and at most 8 columns (decode: the narrow shapes): groups 1 to 8,
    head_dim 37 (a tail on every ISA), 40 (a tail on AVX-512), 64; contexts around the vector
    width and past one key tile (256), windows of 1, 20 and 270 (across the tile boundary)."""
    shapes = [(0, 1), (1, 1), (14, 1), (15, 1), (16, 1), (62, 1), (256, 1), (299, 1)]
    args = make_step(shapes, 2 * group, 2, hd, dtype, seed=group * 100 + hd)
    ops.configure(cpu_isa=isa)
    try:
        for window in (None, 1, 20, 270):
            got = ops.paged_attention(*args, hd**-0.5, window)
            assert_close_to_reference(got, kernel_reference(*args, hd**-0.5, window), dtype)
    finally:
        ops.configure()


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, 37, 300])
def test_a_querys_result_does_not_depend_on_the_step(isa, window):
    """Batch invariance (issue 23): the output at a position has the same bits whether its query
    is computed alone (a decode step), in chunks of any size, all 600 at once, beside other
    sequences, or at 1 or 2 threads; keys past one tile (256), windows across tile bounds."""
    nh, kvh, hd, n = 9, 3, 64, 600
    (q, k_cache, v_cache, tables, _, _) = make_step([(0, n)], nh, kvh, hd, torch.float32, seed=3)
    other = make_step([(40, 30)], nh, kvh, hd, torch.float32, seed=4)

    def run(a, b, with_other=False):
        """Positions [a, b) of the sequence as one step (optionally behind another sequence)."""
        if not with_other:
            return ops.paged_attention(q[a:b], k_cache, v_cache, tables, torch.tensor([b]),
                                       torch.tensor([0, b - a]), 0.125, window)
        oq, ok, ov, ot, ol, oqsl = other
        kc, vc = torch.cat([k_cache, ok]), torch.cat([v_cache, ov])
        width = max(tables.shape[1], ot.shape[1])
        tab = torch.zeros(2, width, dtype=torch.long)
        tab[0, :ot.shape[1]] = ot[0] + k_cache.shape[0]
        tab[1, :tables.shape[1]] = tables[0]
        out = ops.paged_attention(torch.cat([oq, q[a:b]]), kc, vc, tab,
                                  torch.tensor([int(ol[0]), b]),
                                  torch.tensor([0, int(oqsl[1]), int(oqsl[1]) + b - a]), 0.125,
                                  window)
        return out[int(oqsl[1]):]

    ops.configure(cpu_isa=isa)
    try:
        whole = run(0, n)
        assert_close_to_reference(whole, kernel_reference(
            q, k_cache, v_cache, tables, torch.tensor([n]), torch.tensor([0, n]), 0.125, window),
            torch.float32)
        for p in (0, 1, 255, 256, 257, 599):  # alone: one query token
            assert torch.equal(run(p, p + 1), whole[p:p + 1]), p
        for chunk in (7, 96, 250):
            parts = torch.cat([run(a, min(n, a + chunk)) for a in range(0, n, chunk)])
            assert torch.equal(parts, whole), chunk
        assert torch.equal(run(200, 330, with_other=True), whole[200:330])
        torch.set_num_threads(2)
        try:
            assert torch.equal(run(0, n), whole)
            assert torch.equal(run(599, 600), whole[599:])
        finally:
            torch.set_num_threads(1)
    finally:
        ops.configure()


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_long_context(isa):
    """3000 keys (12 key tiles: the online softmax's rescaling) under 200 queries (several
    column tiles), with and without a window that spans tiles; a decode at 3000."""
    args = make_step([(2800, 200), (2999, 1)], 8, 2, 64, torch.float32, seed=11)
    ops.configure(cpu_isa=isa)
    try:
        for window in (None, 700):
            got = ops.paged_attention(*args, 0.125, window)
            assert_close_to_reference(got, kernel_reference(*args, 0.125, window), torch.float32)
    finally:
        ops.configure()


@needs_kernel
def test_kernel_agrees_with_the_torch_path_on_the_classify_step(monkeypatch):
    """SmolLM2's shapes: 8 x 28 queries behind one shared 176-token prefix (the same blocks),
    through build_attention_metadata / paged_attention with and without the kernel."""
    torch.manual_seed(3)
    block, nh, kvh, hd = 16, 9, 3, 64
    prefix = list(range(11))
    tables = [prefix + [11 + 2 * s, 12 + 2 * s] for s in range(8)]
    slots = [t[p // block] * block + p % block for t in tables for p in range(176, 204)]
    batch = ForwardBatch(
        input_ids=torch.zeros(224, dtype=torch.long),
        positions=torch.tensor([p for _ in tables for p in range(176, 204)]),
        slot_mapping=torch.tensor(slots),
        query_start_loc=[28 * s for s in range(9)],
        seq_lens=[204] * 8,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.tensor([223]),
    )
    k_cache, v_cache = torch.randn(32, block, kvh, hd), torch.randn(32, block, kvh, hd)
    q, k, v = torch.randn(224, nh, hd), torch.randn(224, kvh, hd), torch.randn(224, kvh, hd)
    outs = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(attention.ops, "paged_attention_available", lambda d, t: False)
        meta = build_attention_metadata(batch, block)
        assert (meta.kernel is not None) == use_kernel
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, hd**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


@needs_kernel
def test_kernel_threads_and_q_views():
    """Two threads give bitwise the one-thread result (whole tasks per thread); q may be a view
    into a fused qkv output (row stride > nh * hd)."""
    q, *rest = make_step([(176, 28)] * 8 + [(2000, 64)], 9, 3, 64, torch.float32, seed=2)
    qkv = torch.randn(q.shape[0], 15 * 64)
    qkv[:, : 9 * 64] = q.reshape(q.shape[0], -1)
    view = qkv[:, : 9 * 64].view(q.shape)
    assert not view.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.paged_attention(q, *rest, 0.125, None)
        torch.set_num_threads(2)
        two = ops.paged_attention(view, *rest, 0.125, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_writes_the_steps_kv_first(dtype):
    """With k, v and slot_mapping the op first writes the step's K/V at those slots (cast to the
    pool's dtype, bitwise what index_copy_ of k.to(dtype) writes), then attends over them: the
    result is bitwise the read-only call on the pool written by torch. k, v are views into one
    fp32 qkv tensor (row stride > kvh * hd), as in the model."""
    shapes = [(176, 28), (99, 1), (0, 5)]
    q, k_cache, v_cache, tables, lens, qsl = make_step(shapes, 9, 3, 64, dtype, seed=4)
    T, block = q.shape[0], k_cache.shape[1]  # noqa: N806
    qkv = torch.randn(T, 15 * 64)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(T, 3, 64), qkv[:, 12 * 64 :].view(T, 3, 64)
    slots = torch.tensor([int(tables[s, p // block]) * block + p % block
                          for s, (c, n) in enumerate(shapes) for p in range(c, c + n)])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want.view(-1, 3, 64).index_copy_(0, slots, k.to(dtype))
    v_want.view(-1, 3, 64).index_copy_(0, slots, v.to(dtype))
    want = ops.paged_attention(q, k_want, v_want, tables, lens, qsl, 0.125, None)
    got = ops.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, None, k=k, v=v,
                              slot_mapping=slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    assert torch.equal(got, want)
    bad = slots.clone()
    bad[-1] = k_cache.shape[0] * block
    with pytest.raises(ValueError, match=rf"slot_mapping\[{T - 1}\] is .* outside the pool"):
        ops.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, None, k=k, v=v,
                            slot_mapping=bad)
    with pytest.raises(ValueError, match="k, v and slot_mapping together"):
        ops.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, None, k=k, v=v)
    with pytest.raises(ValueError, match="k and v must be"):
        ops.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, None, k=k[:, :2],
                            v=v, slot_mapping=slots)


@needs_kernel
def test_kernel_refuses_bad_inputs():
    q, k_cache, v_cache, tables, lens, qsl = make_step([(5, 3), (0, 2)], 4, 2, 8, torch.float32)

    def call(**kw):
        a = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=lens,
                 query_start_loc=qsl, scale=1.0, window=None)
        a.update(kw)
        return ops.paged_attention(**a)

    bad_table = tables.clone()
    bad_table[1, 0] = k_cache.shape[0]
    cases = [
        (dict(block_tables=bad_table), "sequence 1 block 0 is .* outside the pool"),
        (dict(seq_lens=torch.tensor([8, 1])), "sequence 1 has seq_len 1 < its 2 query tokens"),
        (dict(seq_lens=torch.tensor([33, 2])), "sequence 0 has seq_len 33 for 1 blocks of 16"),
        (dict(query_start_loc=torch.tensor([0, 3, 4])), "query_start_loc must run from 0 to T"),
        (dict(query_start_loc=torch.tensor([0, 4, 3, 5])), r"query_start_loc must be .*\[S \+ 1\]"),
        (dict(block_tables=tables.int()), "block_tables must be contiguous int64"),
        (dict(v_cache=v_cache.bfloat16()), "of one dtype"),
        (dict(q=q.double()), "fp32, bf16 or fp16"),
        (dict(q=q[:, :3]), "num_heads .* must be a multiple of num_kv_heads"),
        (dict(q=q[..., :4]), "q has head_dim 4, the caches 8"),
        (dict(k_cache=k_cache.transpose(0, 1)), "one shape|must be contiguous"),
        (dict(window=-1), "window must be >= 0"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)
    with pytest.raises(ValueError, match="must be contiguous"):
        call(k_cache=torch.randn(k_cache.shape[::-1]).permute(3, 2, 1, 0),
             v_cache=torch.randn(v_cache.shape[::-1]).permute(3, 2, 1, 0))
