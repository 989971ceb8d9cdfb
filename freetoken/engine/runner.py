"""The runner: a SchedulerOutput -> ForwardBatch tensors -> model -> sampler -> StepResults.

No policy here. The lm_head runs only at the rows whose logits are needed (batch.logits_indices):
the last token of each sequence that samples this step, plus the prompt positions of requests
that asked for prompt logprobs.

NOTE (prompt logprobs with prefix-cache hits): vLLM bypasses its prefix cache for requests with
prompt logprobs. We do not: KVCache.hidden keeps the final-norm hidden state of every token in
the pool, written by model.forward next to its K/V. For a cached position q, the logits are
model.compute_logits(kv.hidden[slot(q)]) -- the same lm_head matmul on the same hidden state a
cold run computes, so no recompute and no cache bypass. The logprob of prompt token p (p >= 1)
comes from the logits at position p-1; position 0 has none. Positions computed this step take
their hidden state straight from the forward's output. A step whose logits rows are each its
sequence's last row runs the model with outputs_only (its last layer on those rows alone), and
leaves its other slots without a hidden state: the prompt logprobs of such a cached position
compute it again first (_ensure_hidden), the rare cost of a prefill.
"""

from __future__ import annotations

import torch

from freetoken.engine.batch import ForwardBatch, KVCache
from freetoken.engine.generate import build_forward_batch
from freetoken.engine.sampler import Sampler, SampleRow
from freetoken.engine.scheduler import SchedulerOutput, StepResult

PROMPT_LOGITS_CHUNK = 256  # rows of [V] fp32 logits materialised at once for prompt logprobs
REPLAY_CHUNK = 512  # positions a forward when cached hidden states are computed again


class Runner:
    def __init__(self, model, kv: KVCache, sampler: Sampler, eos_token_ids=()):
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.sampler = sampler
        self.device = kv.hidden.device
        self.eos_token_ids = list(eos_token_ids)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def build_batch(self, out: SchedulerOutput):
        """-> (ForwardBatch, sample row index per scheduled seq (or -1), prompt-logprob plan)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        sample_at: list[int] = []           # index into logits_idx, or -1
        pl_plan: list[tuple[int, list[int], int, int]] = []  # (item idx, cached slots, li0, li1)
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        block_rows: list[list[int]] = []
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            start, end = item.start, item.start + item.num_new_tokens
            base = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            qsl.append(len(input_ids))
            seq_lens.append(end)
            block_rows.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            if item.pl_end > item.pl_start:
                cached = self._slots(seq.block_table, item.pl_start, min(start, item.pl_end))
                li0 = len(logits_idx)
                logits_idx.extend(base + q - start
                                  for q in range(max(start, item.pl_start), item.pl_end))
                pl_plan.append((i, cached, li0, len(logits_idx)))
            if item.sample:
                sample_at.append(len(logits_idx))
                logits_idx.append(base + end - 1 - start)
            else:
                sample_at.append(-1)

        def long(values):
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        batch = ForwardBatch(input_ids=long(input_ids), positions=long(positions),
                             slot_mapping=long(slots), query_start_loc=qsl, seq_lens=seq_lens,
                             block_tables=torch.tensor(block_rows, dtype=torch.int32).to(
                                 self.device),
                             logits_indices=long(logits_idx))
        return batch, sample_at, pl_plan

    def copy_slots(self, copies: list[tuple[int, int, int]]) -> None:
        """Partial prefix hits: the first m slots of block src -> block dst (K, V, hidden)."""
        bs = self.block_size
        src = torch.tensor([s * bs + j for s, _, m in copies for j in range(m)],
                           device=self.device)                                 # [C]
        dst = torch.tensor([d * bs + j for _, d, m in copies for j in range(m)],
                           device=self.device)
        for cache in (*self.kv.k, *self.kv.v):
            flat = cache.view(-1, *cache.shape[2:])                             # [NB*bs, kvh, hd]
            flat[dst] = flat[src]
        self.kv.hidden[dst] = self.kv.hidden[src]
        self.kv.hidden_valid[dst] = self.kv.hidden_valid[src]

    def _ensure_hidden(self, item, cached_slots: list[int]) -> None:
        """The cached prompt positions [pl_start, pl_start + len(cached_slots)) of item's
        sequence with a hidden state in kv.hidden: those a step computed with outputs_only lack
        one, and are computed again from the first such, in their own forwards (their K/V
        rewritten with the same bits: the forward is batch invariant)."""
        valid = self.kv.hidden_valid[torch.tensor(cached_slots, device=self.device)]
        if bool(valid.all()):
            return
        seq, start = item.seq, item.pl_start + int((~valid).nonzero()[0, 0])
        end = item.pl_start + len(cached_slots)
        for a in range(start, end, REPLAY_CHUNK):
            batch = build_forward_batch([(seq.token_ids[a:min(end, a + REPLAY_CHUNK)], a,
                                          seq.block_table)], self.block_size, self.device)
            self.model.forward(batch, self.kv)  # every row's hidden state into kv.hidden

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[StepResult]:
        if out.copies:
            self.copy_slots(out.copies)
        batch, sample_at, pl_plan = self.build_batch(out)
        results = [StepResult() for _ in out.scheduled]
        for i, cached_slots, _, _ in pl_plan:
            if cached_slots:
                self._ensure_hidden(out.scheduled[i], cached_slots)
        hidden = self.model.forward(batch, self.kv, outputs_only=True)     # [N, H]

        for i, cached_slots, li0, li1 in pl_plan:
            item = out.scheduled[i]
            seq = item.seq
            k = seq.params.prompt_logprobs or 0
            parts = []
            if cached_slots:
                parts.append(self.kv.hidden[torch.tensor(cached_slots, device=self.device)])
            if li1 > li0:
                parts.append(hidden[li0:li1])
            h = torch.cat(parts) if len(parts) > 1 else parts[0]           # [P, H]
            targets = seq.token_ids[item.pl_start + 1:item.pl_end + 1]      # prompt ids p = q+1
            for c in range(0, h.shape[0], PROMPT_LOGITS_CHUNK):
                logits = self.model.compute_logits(h[c:c + PROMPT_LOGITS_CHUNK])  # [<=C, V]
                results[i].prompt_logprobs.extend(self.sampler.prompt_logprobs(
                    logits, targets[c:c + PROMPT_LOGITS_CHUNK], k))

        rows, where = [], []
        for i, item in enumerate(out.scheduled):
            if sample_at[i] < 0:
                continue
            seq = item.seq
            p = seq.params
            suppress = ()
            if seq.num_output_tokens < p.min_tokens:
                suppress = tuple(p.stop_token_ids) + (() if p.ignore_eos
                                                      else tuple(self.eos_token_ids))
                if p.allowed_token_ids is not None and set(p.allowed_token_ids) <= set(suppress):
                    suppress = ()  # nothing else may be sampled: min_tokens cannot hold
            rows.append(SampleRow(p, seq.seed, seq.num_output_tokens, seq.token_ids,
                                  seq.num_prompt_tokens, suppress))
            where.append(i)
        if rows:
            picked = [sample_at[i] for i in where]
            if picked != list(range(hidden.shape[0])):  # a decode step samples every row
                hidden = hidden.index_select(0, torch.tensor(picked, device=self.device))
            logits = self.model.compute_logits(hidden)                         # [B, V] fp32
            for i, (token, lp) in zip(where, self.sampler.sample(logits, rows)):
                results[i].token_id = token
                results[i].logprob = lp
        return results
