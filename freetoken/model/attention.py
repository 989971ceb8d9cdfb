"""Paged attention over the KV pool: write K/V by slot_mapping, read each sequence's context by its
block_table, attend with torch SDPA.

This is the pure-torch path (the fallback for everything): the context is gathered from the pool
into a dense tensor per step. Decode sequences (one query token each) are attended in one padded,
masked SDPA call; sequences with several query tokens (prefill, chunked prefill) one call each.
Not here: block allocation, prefix hashing (kv_cache.py), any policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.batch import ForwardBatch


@dataclass(slots=True)
class PrefillPiece:
    """One sequence with several query tokens this step."""

    q_start: int  # its tokens are q_start:q_end of the step
    q_end: int
    ctx_slots: torch.Tensor | None  # [L] int64 flat KV slots of its context; None = no prefix
    mask: torch.Tensor | None  # [1, 1, q, L] bool (True = attend); None = plain causal


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs, built once per forward from the ForwardBatch (same for every
    layer). Plain data; passed down explicitly, never stored on a module."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_token_idx: torch.Tensor | None  # [Sd] int64 indices into T of one-token sequences
    decode_ctx_slots: torch.Tensor | None  # [Sd, Ld] int64 (padding points at slot 0, masked)
    decode_mask: torch.Tensor | None  # [Sd, 1, 1, Ld] bool
    prefills: list[PrefillPiece]


def _context_slots(block_table: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    # block_table: [..., max_blocks] int32 -> slots [..., num_positions] int64 for positions 0..L-1
    pos = torch.arange(num_positions, device=block_table.device)
    block_idx = (pos // block_size).clamp_(max=block_table.shape[-1] - 1)
    blocks = block_table[..., block_idx].long()  # [..., L]
    return blocks * block_size + pos % block_size


def build_attention_metadata(
    batch: ForwardBatch, block_size: int, sliding_window: int | None = None
) -> AttentionMetadata:
    device = batch.slot_mapping.device
    qsl = batch.query_start_loc
    block_tables = batch.block_tables.to(device)
    decode_seqs, prefills = [], []
    for s, seq_len in enumerate(batch.seq_lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        num_q = q_end - q_start
        if num_q <= 0:
            continue
        if num_q > seq_len:
            raise ValueError(f"sequence {s} has {num_q} query tokens but seq_len {seq_len}")
        if num_q == 1:
            decode_seqs.append(s)
            continue
        if seq_len == num_q and sliding_window is None:
            # Whole context computed this step: causal over the fresh K/V, no gather needed.
            prefills.append(PrefillPiece(q_start, q_end, None, None))
            continue
        slots = _context_slots(block_tables[s], seq_len, block_size)  # [L]
        q_pos = torch.arange(seq_len - num_q, seq_len, device=device)  # [q]
        k_pos = torch.arange(seq_len, device=device)  # [L]
        mask = k_pos[None, :] <= q_pos[:, None]  # [q, L]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        prefills.append(PrefillPiece(q_start, q_end, slots, mask[None, None]))

    decode_idx = decode_slots = decode_mask = None
    if decode_seqs:
        lens = [batch.seq_lens[s] for s in decode_seqs]
        seq_lens = torch.tensor(lens, device=device)  # [Sd]
        max_len = max(lens)  # from the host list: no device sync
        decode_slots = _context_slots(block_tables[decode_seqs], max_len, block_size)  # [Sd, Ld]
        k_pos = torch.arange(max_len, device=device)[None, :]  # [1, Ld]
        valid = k_pos < seq_lens[:, None]  # [Sd, Ld]
        if sliding_window is not None:
            valid &= k_pos > seq_lens[:, None] - 1 - sliding_window
        decode_slots = torch.where(valid, decode_slots, 0)
        decode_mask = valid[:, None, None, :]
        decode_idx = torch.tensor([qsl[s] for s in decode_seqs], device=device)
    return AttentionMetadata(batch.slot_mapping, decode_idx, decode_slots, decode_mask, prefills)


def _gather(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # flat: [num_slots, kvh, hd]; slots: [..., L] -> [..., L, kvh, hd] in `dtype`
    out = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])
    return out.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, kvh, hd] (RoPE applied); k_cache, v_cache: [NB, bs, kvh, hd].

    Writes k/v at meta.slot_mapping, then attends. Returns [T, nh, hd] in q's dtype.
    """
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [NB*bs, kvh, hd]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    # NOTE: index_copy_/index_select over flat slots, not advanced indexing: ~3x faster on CPU.
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
    out = torch.empty_like(q)  # [T, nh, hd]

    if meta.decode_token_idx is not None:
        qd = q[meta.decode_token_idx].unsqueeze(2)  # [Sd, nh, 1, hd]
        kd = _gather(k_flat, meta.decode_ctx_slots, q.dtype).transpose(1, 2)  # [Sd, kvh, Ld, hd]
        vd = _gather(v_flat, meta.decode_ctx_slots, q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )  # [Sd, nh, 1, hd]
        out[meta.decode_token_idx] = od.squeeze(2)

    for piece in meta.prefills:
        a, b = piece.q_start, piece.q_end
        qp = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, nh, q, hd]
        if piece.ctx_slots is None:
            kp = k[a:b].to(k_flat.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kvh, q, hd]
            vp = v[a:b].to(v_flat.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kp = _gather(k_flat, piece.ctx_slots, q.dtype).transpose(0, 1).unsqueeze(0)
            vp = _gather(v_flat, piece.ctx_slots, q.dtype).transpose(0, 1).unsqueeze(0)
            # kp, vp: [1, kvh, L, hd]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=piece.mask, scale=scale, enable_gqa=True
            )
        out[a:b] = op[0].transpose(0, 1)  # [q, nh, hd]
    return out
