"""paged_attention: causal attention of any number of query tokens per sequence over the paged
K/V pool, read in place (csrc/attention/), on the CPU extension.

Its torch twin is not here: freetoken/model/attention.py keeps the gather + SDPA path, which the
model takes wherever paged_attention_available() is False and which
tests/unit/test_attention.py holds this kernel to. Not the metadata (block tables, groups):
that is model/attention.py too.
"""

from __future__ import annotations

import torch

from freetoken.ops.backend import _C, backend_for, require_ext

_PAGED_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_attention_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when freetoken._C serves paged_attention for `dtype` tensors on `device` (the CPU
    extension in use, fp32 / bf16 / fp16); otherwise freetoken/model/attention.py keeps its torch
    path (gather + SDPA), which is also this kernel's reference in tests/unit/test_attention.py."""
    return dtype in _PAGED_ATTENTION_DTYPES and backend_for(device) == "ext-cpu"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int | None, *,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                    slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, nh, hd] (heads contiguous, any row stride); k_cache, v_cache [NB, bs, kvh, hd]
    contiguous, one dtype; block_tables int64 [S, nb], seq_lens int64 [S], query_start_loc int64
    [S + 1], all contiguous. Sequence s's query tokens are rows qsl[s]..qsl[s+1]-1 at positions
    seq_lens[s] - n_q + i; each attends causally to keys 0..its position read in place from the
    pool through block_tables (window: only keys p > pos - window), head h to kv head
    h // (nh // kvh). fp32 scores, softmax and sums. -> [T, nh, hd] in q's dtype. Bad arguments
    (a block outside the pool, seq_len < n_q, shapes, dtypes) raise ValueError. No autograd.

    With k, v [T, kvh, hd] (heads contiguous) and slot_mapping int64 [T], the step's new K/V are
    first written into the pools at those flat slots (cast to the pool's dtype), as
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k) would."""
    require_ext("paged_attention")
    return _C.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              float(scale), int(window or 0), k, v, slot_mapping)
