"""Paged attention over the KV pool: write K/V by slot_mapping, read each sequence's context by its
block_table, attend.

On the CPU with freetoken._C (fp32 / bf16 / fp16), every sequence of the step, decode or
multi-token, goes through one call per layer (ops.paged_attention, csrc/attention/):
K/V read in place from the pool, causal, GQA, sliding window; its inputs are built once per
forward (KernelArgs). Everything else, and the reference for that kernel in tests, is torch: the
context is gathered from the pool block by block into a dense tensor, then SDPA, in padded
groups, one call per group and layer: every decode sequence (one query token) in one group; the
sequences with several query tokens (prefill, chunked prefill, a prompt
behind a cached prefix) in another, unless padding them to the longest would more than double the
work, in which case each goes alone. A prompt alone with no cached context is causal over its
fresh K/V, with no gather.
Not here: block allocation, prefix hashing (engine/kv_cache.py), any policy.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken import ops
from freetoken.engine.batch import ForwardBatch

MAX_PADDING_WASTE = 2.0  # a padded group may cost at most this many times its real query x key work


@dataclass(slots=True)
class AttentionGroup:
    """S sequences in one padded SDPA call: Q query rows each (the group's longest; a shorter
    sequence repeats its last query token, whose output is dropped) over L context positions."""

    num_seqs: int
    num_q: int
    # [S*Q] token index (into T) of each padded row; None: they are rows_start..rows_start+S*Q
    q_rows: torch.Tensor | None
    rows_start: int
    keep: torch.Tensor | None  # [Tg] which padded rows are real; None = all
    out_rows: torch.Tensor | None  # [Tg] where the real rows go in T; None = all of T, in order
    block_table: torch.Tensor  # [S, nb] int64 blocks covering the context (padding: block 0)
    ctx_len: int  # L
    seq_lens: torch.Tensor  # [S] int64 context length of each sequence
    window: int | None  # the sliding window, None = none
    mask: torch.Tensor  # [S, 1, Q, L] additive: 0 = attend, -inf = not (bool costs SDPA a where)


@dataclass(slots=True)
class FreshPrefill:
    """A sequence whose whole context is computed this step, alone: causal over its fresh K/V."""

    q_start: int
    q_end: int


@dataclass(slots=True)
class KernelArgs:
    """ops.paged_attention's inputs besides q and the pools: every sequence of the step."""

    block_tables: torch.Tensor  # [S, nb] int64, contiguous
    seq_lens: torch.Tensor  # [S] int64
    query_start_loc: torch.Tensor  # [S+1] int64
    window: int | None  # the sliding window, None = none


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs, built once per forward from the ForwardBatch (same for every
    layer). Plain data; passed down explicitly, never stored on a module. With `kernel` set, the
    torch plan (groups, fresh) is left empty: one ops.paged_attention call serves the step."""

    slot_mapping: torch.Tensor  # [T] int64
    groups: list[AttentionGroup]
    fresh: list[FreshPrefill]
    kernel: KernelArgs | None = None


def _make_group(
    members: list[int],
    batch: ForwardBatch,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> AttentionGroup:
    device = batch.slot_mapping.device
    qsl = batch.query_start_loc
    num_q = [qsl[s + 1] - qsl[s] for s in members]
    lens = [batch.seq_lens[s] for s in members]
    S, Q, L = len(members), max(num_q), max(lens)  # noqa: N806 - the shapes' names
    nb = -(-L // block_size)
    rows = [qsl[s] + min(i, n - 1) for s, n in zip(members, num_q) for i in range(Q)]
    contiguous = rows == list(range(rows[0], rows[0] + S * Q))
    keep = None if min(num_q) == Q else [s * Q + i for s, n in enumerate(num_q) for i in range(n)]
    # Position of each padded query row: a padding row repeats its sequence's last token.
    last_pos = torch.tensor([n - 1 for n in lens], device=device)[:, None]  # [S, 1]
    offset = torch.tensor([n - q for n, q in zip(lens, num_q)], device=device)[:, None]
    q_pos = torch.minimum(offset + torch.arange(Q, device=device)[None, :], last_pos)  # [S, Q]
    k_pos = torch.arange(L, device=device)  # [L]
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, -math.inf)
    real_rows = [qsl[s] + i for s, n in zip(members, num_q) for i in range(n)]
    everything = real_rows == list(range(batch.num_tokens))
    long = dict(dtype=torch.long, device=device)
    return AttentionGroup(
        num_seqs=S,
        num_q=Q,
        q_rows=None if contiguous else torch.tensor(rows, **long),
        rows_start=rows[0],
        keep=None if keep is None else torch.tensor(keep, **long),
        out_rows=None if everything else torch.tensor(real_rows, **long),
        block_table=block_tables[members, :nb].long(),
        ctx_len=L,
        seq_lens=torch.tensor(lens, **long),
        window=sliding_window,
        mask=mask[:, None],
    )


def build_attention_metadata(
    batch: ForwardBatch,
    block_size: int,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """dtype: the model's (queries and masks)."""
    qsl = batch.query_start_loc
    block_tables = batch.block_tables.to(batch.slot_mapping.device)
    decodes, multi = [], []
    for s, seq_len in enumerate(batch.seq_lens):
        num_q = qsl[s + 1] - qsl[s]
        if num_q <= 0:
            continue
        if num_q > seq_len:
            raise ValueError(f"sequence {s} has {num_q} query tokens but seq_len {seq_len}")
        (decodes if num_q == 1 else multi).append(s)
    if ops.paged_attention_available(batch.slot_mapping.device, dtype):
        long = dict(dtype=torch.long, device=batch.slot_mapping.device)
        kernel = KernelArgs(
            block_tables=block_tables.to(torch.long).contiguous(),
            seq_lens=torch.tensor(batch.seq_lens, **long),
            query_start_loc=torch.tensor(qsl, **long),
            window=sliding_window,
        )
        return AttentionMetadata(batch.slot_mapping.to(torch.long).contiguous(), [], [], kernel)

    def make(members):
        return _make_group(members, batch, block_tables, block_size, sliding_window, dtype)

    groups, fresh = [], []
    if decodes:
        groups.append(make(decodes))
    if len(multi) > 1:
        q_len = [qsl[s + 1] - qsl[s] for s in multi]
        lens = [batch.seq_lens[s] for s in multi]
        real = sum(q * n for q, n in zip(q_len, lens))
        if len(multi) * max(q_len) * max(lens) <= MAX_PADDING_WASTE * real:
            groups.append(make(multi))
            multi = []
    for s in multi:
        if batch.seq_lens[s] == qsl[s + 1] - qsl[s] and sliding_window is None:
            fresh.append(FreshPrefill(qsl[s], qsl[s + 1]))
        else:
            groups.append(make([s]))
    return AttentionMetadata(batch.slot_mapping, groups, fresh)


def _gather_context(cache: torch.Tensor, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    # cache: [NB, bs, kvh, hd] -> [S, kvh, L, hd] in `dtype`, by whole blocks
    blocks = cache.index_select(0, group.block_table.reshape(-1))  # [S*nb, bs, kvh, hd]
    ctx = blocks.view(group.num_seqs, -1, *cache.shape[2:])[:, : group.ctx_len]
    return ctx.to(dtype).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    elementwise=nullcontext,
) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, kvh, hd] (RoPE applied); k_cache, v_cache: [NB, bs, kvh, hd].

    Writes k/v at meta.slot_mapping, then attends. Returns [T, nh, hd] in q's dtype.
    `elementwise` is the thread context of the copies and gathers (see model/llama.py); SDPA
    itself runs on every thread.
    """
    num_tokens, num_heads, head_dim = q.shape
    if meta.kernel is not None:
        # every sequence, K/V written and then read in place (csrc/attention/)
        kn = meta.kernel
        return ops.paged_attention(q, k_cache, v_cache, kn.block_tables, kn.seq_lens,
                                   kn.query_start_loc, scale, kn.window, k=k, v=v,
                                   slot_mapping=meta.slot_mapping)  # [T, nh, hd]
    with elementwise():
        num_kv_heads = k_cache.shape[-2]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [NB*bs, kvh, hd]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        # NOTE: index_copy_ over flat slots, not advanced indexing: ~3x faster on CPU.
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

    everything = slice(0, num_tokens)
    outputs = []  # (rows of T: a slice or an index tensor, [rows, nh, hd])
    for g in meta.groups:
        S, Q = g.num_seqs, g.num_q  # noqa: N806
        with elementwise():
            if g.q_rows is None:
                qg = q[g.rows_start : g.rows_start + S * Q]
            else:
                qg = q.index_select(0, g.q_rows)
        with elementwise():
            qg = qg.view(S, Q, num_heads, head_dim).transpose(1, 2)  # [S, nh, Q, hd]
            kg = _gather_context(k_cache, g, q.dtype)  # [S, kvh, L, hd]
            vg = _gather_context(v_cache, g, q.dtype)
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True
        )  # [S, nh, Q, hd]
        with elementwise():
            og = og.transpose(1, 2).reshape(S * Q, num_heads, head_dim)
            rows = everything if g.out_rows is None else g.out_rows
            outputs.append((rows, og if g.keep is None else og.index_select(0, g.keep)))

    for piece in meta.fresh:
        a, b = piece.q_start, piece.q_end
        qp = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, nh, q, hd]
        # Rounded through the cache dtype, as a later step reading the pool would see them.
        kp = k[a:b].to(k_flat.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kvh, q, hd]
        vp = v[a:b].to(v_flat.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                            enable_gqa=True)
        outputs.append((slice(a, b), op[0].transpose(0, 1)))

    if len(outputs) == 1 and outputs[0][0] == everything:
        return outputs[0][1]
    with elementwise():
        out = torch.empty_like(q)  # [T, nh, hd]
        for rows, o in outputs:
            if isinstance(rows, slice):
                out[rows] = o
            else:
                out.index_copy_(0, rows, o)
    return out
