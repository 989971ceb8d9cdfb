"""Paged attention against a dense fp64 reference, on random steps that mix decodes, prompts
behind a cached context, fresh prompts and chunks of unequal lengths: the padded groups, the
split when padding would waste too much, the fresh causal path, sliding windows, GQA."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken.batch import ForwardBatch
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


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_matches_dense_reference(name, window):
    rng = random.Random(hash((name, window)) & 0xFFFF)
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
