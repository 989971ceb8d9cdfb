"""Paged attention against a dense fp64 reference, on random steps that mix decodes, prompts
behind a cached context, fresh prompts and chunks of unequal lengths: the padded groups, the
split when padding would waste too much, the fresh causal path, sliding windows, GQA."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken import ops
from freetoken.batch import ForwardBatch
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


IMPLS = ["torch"] + (["ext"] if ops.paged_decode_available(torch.device("cpu")) else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_matches_dense_reference(name, window, impl, monkeypatch):
    """impl ext: decode groups through csrc/attention_cpu.cpp; torch: gather + SDPA for all."""
    if impl == "torch":
        monkeypatch.setattr(attention.ops, "paged_decode_available", lambda device: False)
    rng = random.Random(sum(map(ord, name)) * 7 + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    batch, tables = random_step(rng, STEPS[name])
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KVH, HD)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KVH, HD)
    T = batch.num_tokens  # noqa: N806
    q, k, v = torch.randn(T, NH, HD), torch.randn(T, KVH, HD), torch.randn(T, KVH, HD)
    meta = build_attention_metadata(batch, BLOCK, window)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HD**-0.5)
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


def test_groups_are_what_the_docstring_says():
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


@pytest.mark.skipif("ext" not in IMPLS, reason="freetoken._C is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_against_the_torch_path(dtype):
    """Longer contexts (up to 300), GQA 4:1, head_dim 80 (not a multiple of 16), bf16 pools."""
    g = torch.Generator().manual_seed(3)
    S, nh, kvh, hd, bs, nb = 5, 8, 2, 80, 16, 100  # noqa: N806
    k_cache = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    q = torch.randn(S, nh, hd, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 300, 64, 129])
    table = torch.randperm(nb, generator=g)[: S * 19].view(S, 19)
    for window in (None, 50):
        got = ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.11, window)
        assert got.dtype == dtype and got.shape == q.shape
        for s in range(S):
            n = int(lens[s])
            slots = [int(table[s, p // bs]) * bs + p % bs for p in range(n)]
            k_ctx = k_cache.view(-1, kvh, hd)[slots].float()
            v_ctx = v_cache.view(-1, kvh, hd)[slots].float()
            q_s = q[s : s + 1].float() * (0.11 / hd**-0.5)  # reference() scales by hd**-0.5
            want = reference(q_s, k_ctx, v_ctx, [n - 1], window)[0]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[s].double(), want, atol=tol, rtol=0)


@pytest.mark.skipif("ext" not in IMPLS, reason="freetoken._C is not built")
def test_decode_kernel_refuses_bad_tables():
    q = torch.randn(1, 4, 8)
    cache = torch.randn(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode_attention(q, cache, cache, torch.tensor([[0, 9]]), torch.tensor([6]),
                                   1.0, None)
    with pytest.raises(RuntimeError, match="seq_len"):
        ops.paged_decode_attention(q, cache, cache, torch.tensor([[0, 1]]), torch.tensor([9]),
                                   1.0, None)
