"""generate(loaded, prompt_ids, max_new_tokens): greedy ids + logprobs with the bare model, no
engine or server. For checking the model (tests, parity, benchmarks); of it the engine uses only
build_forward_batch (the runner's recompute of cached hidden states).

NOTE (threads and OpenMP wait policy, measured with scripts/bench_forward.py
--compare-wait-policy on the shared 2-core EPYC dev box, load average ~3, SmolLM2 fp32):

    OMP_WAIT_POLICY  threads  prefill tok/s  decode tok/s  4-way batched decode tok/s
    PASSIVE          1        276            16.9          30.3
    PASSIVE          2        145             8.3          18.8
    (default)        1        232             6.7          19.2
    (default)        2         46             2.4           5.7

torch's OpenMP workers spin-wait after every parallel region; when the cores are shared, the
spinning thread steals the core the other thread needs and a decode step gets ~7x slower. So the
server should (1) set OMP_WAIT_POLICY=PASSIVE in the environment before torch is imported (OpenMP
reads it once, at start-up), with os.environ.setdefault so a user's own setting wins, and (2) use
torch.set_num_threads(max(1, os.cpu_count() // 2)) unless OMP_NUM_THREADS is set: one thread per
physical core, which is 1 on these 2-vCPU machines, where a second thread lost even with PASSIVE.
Log both values once at start-up.
"""

from __future__ import annotations

import math

import torch

from freetoken.engine.batch import ForwardBatch, KVCache


def build_forward_batch(
    seqs: list[tuple[list[int], int, list[int]]],
    block_size: int,
    device: torch.device | str = "cpu",
    all_logits: bool = False,
) -> ForwardBatch:
    """A ForwardBatch for several sequences, each (new_token_ids, num_computed_tokens, block_ids):
    the new tokens sit at positions num_computed..num_computed+len-1 of that sequence, whose KV
    lives in blocks block_ids (in order). Logits at each sequence's last token (or every token)."""
    input_ids, positions, slots, qsl, seq_lens, logits_idx = [], [], [], [0], [], []
    max_blocks = max(len(b) for _, _, b in seqs)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)  # [S, max_blocks]
    for s, (token_ids, num_computed, block_ids) in enumerate(seqs):
        if not token_ids:
            raise ValueError(f"sequence {s} has no new tokens")
        seq_len = num_computed + len(token_ids)
        if seq_len > len(block_ids) * block_size:
            raise ValueError(f"sequence {s}: {seq_len} tokens do not fit {len(block_ids)} blocks")
        block_tables[s, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        for pos in range(num_computed, seq_len):
            positions.append(pos)
            slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        first = len(input_ids)
        input_ids.extend(token_ids)
        qsl.append(len(input_ids))
        seq_lens.append(seq_len)
        logits_idx.extend(range(first, len(input_ids)) if all_logits else [len(input_ids) - 1])

    def as_long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=as_long(input_ids),
        positions=as_long(positions),
        slot_mapping=as_long(slots),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=block_tables.to(device),
        logits_indices=as_long(logits_idx),
    )


@torch.inference_mode()
def generate(
    loaded,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int = 16,
    stop_at_eos: bool = False,
) -> tuple[list[int], list[float]]:
    """Greedy continuation of prompt_ids: (new token ids, their logprobs). Blocks are allocated
    sequentially (0, 1, 2, ...) for the one sequence. Stops early at EOS only if stop_at_eos."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    model = loaded.model
    device = model.device
    total = len(prompt_ids) + max_new_tokens
    num_blocks = max(1, math.ceil(total / block_size))
    kv: KVCache = model.make_kv_cache(num_blocks, block_size)
    block_ids = list(range(num_blocks))
    eos = set(loaded.eos_token_ids)
    out_ids: list[int] = []
    out_logprobs: list[float] = []
    step_ids, pos = list(prompt_ids), 0
    for _ in range(max_new_tokens):
        batch = build_forward_batch([(step_ids, pos, block_ids)], block_size, device)
        logits = model.compute_logits(model.forward(batch, kv))[0]  # [V] fp32
        token = int(torch.argmax(logits))
        out_ids.append(token)
        out_logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        pos += len(step_ids)
        step_ids = [token]
        if stop_at_eos and token in eos:
            break
    return out_ids, out_logprobs
