"""Plain data that crosses scheduler -> runner -> model. Nothing here holds policy.

A step computes T new tokens belonging to S sequences, concatenated in sequence order.
Sequence s owns tokens query_start_loc[s]:query_start_loc[s+1] of the step; they sit at the
end of its context, whose full length after this step is seq_lens[s] (cached + new tokens).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64, the tokens computed this step
    positions: torch.Tensor        # [T] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor     # [T] int64, flat KV slot to write: block * block_size + offset
    query_start_loc: list[int]     # [S+1], offsets of each sequence's tokens in the step
    seq_lens: list[int]            # [S], context length of each sequence after this step
    block_tables: torch.Tensor     # [S, max_blocks] int32, the sequence's blocks in order (pad: 0)
    logits_indices: torch.Tensor   # [N] int64, indices into T whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On the CPU it lies in fresh anonymous memory, zero by the kernel's promise and
    resident only once written: the pool's untouched blocks cost no RAM (torch.zeros wrote all
    512 MiB of the default pool at start, most of a small model's peak RSS)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class KVCache:
    """The paged KV pool plus the final hidden state of every cached token.

    k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
    hidden:             [num_blocks * block_size, hidden_size] -- the final-norm hidden state of the
                        token in each slot, so prompt logprobs of prefix-cache hits cost one lm_head
                        matmul instead of a recompute (see docs/architecture.md).
    hidden_valid:       [num_blocks * block_size] bool -- whether hidden holds the slot's state: a
                        step whose last layer went on with only its logits rows (model.forward,
                        outputs_only) leaves its other slots without one.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.hidden = _zeros((num_blocks * block_size, hidden_size), dtype, device)
        self.hidden_valid = _zeros((num_blocks * block_size,), torch.bool, device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        hidden_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (elem * block_size * (2 * num_layers * num_kv_heads * head_dim + hidden_size)
                + block_size)  # + hidden_valid
