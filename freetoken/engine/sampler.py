"""Per-row sampling and logprobs for one step's logits, with one freetoken.ops call each.

Not here: the kernels themselves (freetoken/ops/), deciding "finished" (sequence.py).

Semantics (SPEC.md):
  * logprobs are the log-softmax of the logits after logit_bias, over the allowed set when
    allowed_token_ids is given, before temperature / top-k / top-p / min-p and before penalties;
    the sampled token's logprob = logit + bias - lse, and the same for logprob_token_ids;
    rank = 1 + the number of (masked, biased) logits strictly greater.
  * with allowed_token_ids, a row asking for logprobs also gets allowed_mass = lse - full_lse:
    the log of the mass the full (biased) distribution puts on the set, both log-sum-exps from
    the kernel's one pass (ops.topk_logprobs(full_lse=True)).
  * every row goes through ops.topk_logprobs (top-K ids, their logprobs, lse) in one call;
    a greedy row takes its first id. Rows that are not greedy, or whose sampling logits differ
    from the model's (penalties, min_tokens), go through ops.sample_tokens in one call.
  * penalties (vLLM semantics) change only the sampling logits: repetition over prompt + output
    (positive logits divided, negative multiplied), then frequency * count and presence * [count
    > 0] over the output. For those rows logit_bias is added in torch first, so the kernel sees
    an empty bias range. min_tokens masks EOS and stop_token_ids in the sampling logits only.
  * prompt logprobs are the model's raw log-softmax (no bias, no mask): a score of the prompt,
    independent of the request's sampling constraints, as vLLM computes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from freetoken import ops
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    step: int                    # index of the token being sampled (num output tokens so far)
    token_ids: Seq[int]          # prompt + output so far (penalties)
    num_prompt_tokens: int
    suppress_ids: Seq[int] = ()  # EOS / stop ids masked while min_tokens is not reached


def _ranges(rows: Seq[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    offsets, flat = [0], []
    for ids in rows:
        flat.extend(ids)
        offsets.append(len(flat))
    return (torch.tensor(offsets, dtype=torch.int32, device=device),
            torch.tensor(flat, dtype=torch.int32, device=device))


def _allowed_arg(params: Seq[SamplingParams], device):
    if all(p.allowed_token_ids is None for p in params):
        return None
    return _ranges([p.allowed_token_ids or [] for p in params], device)


def _bias_arg(biases: Seq[dict[int, float]], device):
    if not any(biases):
        return None
    offsets, ids = _ranges([list(b) for b in biases], device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32,
                          device=device)
    return offsets, ids, values


def _masked_biased(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> a copy with logit_bias added and disallowed ids at -inf."""
    out = logits.float().clone()
    for r, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=out.device)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
            out[r].index_add_(0, ids, vals)
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, device=out.device)
            row = torch.full_like(out[r], float("-inf"))
            row[keep] = out[r, keep]
            out[r] = row
    return out


def _apply_penalties(logits: torch.Tensor, rows: Seq[SampleRow]) -> None:
    """In place on the sampling logits [R, V] (bias already added)."""
    vocab = logits.shape[1]
    for r, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.token_ids:
            seen = torch.tensor(sorted(set(row.token_ids)), device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[r, seen]
            logits[r, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        out_ids = list(row.token_ids[row.num_prompt_tokens:])
        if out_ids and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            ids = torch.tensor(out_ids, device=logits.device)
            counts.index_add_(0, ids, torch.ones(len(out_ids), dtype=logits.dtype,
                                                 device=logits.device))
            logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


class Sampler:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]
               ) -> list[tuple[int, TokenLogprob | None]]:
        """logits [B, V] fp32, one row per sequence to sample -> (token id, logprob or None)."""
        if not rows:
            return []
        dev = logits.device
        params = [r.params for r in rows]
        allowed = _allowed_arg(params, dev)
        bias = _bias_arg([p.logit_bias for p in params], dev)
        k = max(1, max(p.logprobs or 0 for p in params))
        mass_rows = [i for i, p in enumerate(params)
                     if p.logprobs is not None and p.allowed_token_ids is not None]
        top_ids, top_lps, lse, *full = ops.topk_logprobs(  # [B,k] [B,k] [B] (+ [B])
            logits, k, allowed, bias, full_lse=bool(mass_rows))
        tokens = top_ids[:, 0].clone()                                       # [B] greedy ids
        mass: dict[int, float | None] = {}
        if mass_rows:
            lse_l, full_l = lse.tolist(), full[0].tolist()
            for i in mass_rows:
                m = lse_l[i] - full_l[i]
                # <= 0 up to rounding; a NaN / +inf logit outside the set has no finite mass
                mass[i] = min(m, 0.0) if math.isfinite(m) else None

        modified = [i for i, r in enumerate(rows)
                    if r.params.has_penalties or r.suppress_ids]
        stochastic = [i for i, r in enumerate(rows) if not r.params.greedy or i in modified]
        if stochastic:
            idx = torch.tensor(stochastic, device=dev)
            sub_logits = logits.index_select(0, idx)                          # [S, V]
            sub_params = [params[i] for i in stochastic]
            sub_bias = [p.logit_bias for p in sub_params]
            mod_local = [j for j, i in enumerate(stochastic) if i in set(modified)]
            if mod_local:
                sub_logits = sub_logits.float().clone()
                for j in mod_local:
                    row = rows[stochastic[j]]
                    if row.params.logit_bias:
                        b = row.params.logit_bias
                        sub_logits[j].index_add_(
                            0, torch.tensor(list(b), device=dev),
                            torch.tensor(list(b.values()), dtype=sub_logits.dtype, device=dev))
                        sub_bias[j] = {}
                    if row.suppress_ids:
                        ids = torch.tensor(list(row.suppress_ids), device=dev)
                        sub_logits[j, ids[ids < sub_logits.shape[1]]] = float("-inf")
                _apply_penalties_subset(sub_logits, [rows[stochastic[j]] for j in mod_local],
                                        mod_local)
            f32 = dict(dtype=torch.float32, device=dev)
            sampled = ops.sample_tokens(
                sub_logits, _allowed_arg(sub_params, dev), _bias_arg(sub_bias, dev),
                torch.tensor([p.temperature for p in sub_params], **f32),
                torch.tensor([p.top_k for p in sub_params], dtype=torch.int32, device=dev),
                torch.tensor([p.top_p for p in sub_params], **f32),
                torch.tensor([p.min_p for p in sub_params], **f32),
                torch.tensor([rows[i].seed for i in stochastic], dtype=torch.int64, device=dev),
                torch.tensor([rows[i].step for i in stochastic], dtype=torch.int64, device=dev))
            tokens[idx] = sampled.to(tokens.dtype)

        tokens_l = tokens.tolist()
        top_ids_l, top_lps_l = top_ids.tolist(), top_lps.tolist()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        # NOTE: a greedy row's token is its top-1, the max of the masked, biased logits: its
        # logprob is the top list's and its rank 1 (nothing is strictly greater), so only the
        # other rows (and those asking for logprob_token_ids) take a pass over the vocabulary.
        sampled_rows = set(stochastic)
        full = [i for i in want if i in sampled_rows or params[i].logprob_token_ids
                or top_lps_l[i][0] == _NEG_INF]
        chosen_lp: dict[int, float] = {}
        rank: dict[int, int] = {}
        extra: dict[int, list[tuple[int, float]]] = {}
        if full:
            # NOTE: logit - lse can differ from the kernel's top-K value in the last ulp; a token
            # that is also in its top list reports the top list's number (below), so one token
            # never shows two logprobs in one response.
            widx = torch.tensor(full, device=dev)
            mb = _masked_biased(logits.index_select(0, widx), [params[i] for i in full])  # [W,V]
            tok = tokens[widx]                                                    # [W]
            val = mb.gather(1, tok[:, None])                                      # [W, 1]
            lps = (val[:, 0] - lse[widx]).tolist()
            ranks = ((mb > val).sum(-1) + 1).tolist()
            for j, i in enumerate(full):
                chosen_lp[i], rank[i] = lps[j], ranks[j]
                ids = params[i].logprob_token_ids
                if ids:
                    t = torch.tensor(ids, device=dev)
                    extra[i] = list(zip(ids, (mb[j, t] - lse[i]).tolist()))
        out: list[tuple[int, TokenLogprob | None]] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append((tokens_l[i], None))
                continue
            kk = p.logprobs
            top = [(t, lp) for t, lp in zip(top_ids_l[i][:kk], top_lps_l[i][:kk])
                   if t >= 0 and lp != _NEG_INF]
            in_top = dict(top)
            if i in chosen_lp:
                lp, rk = in_top.get(tokens_l[i], chosen_lp[i]), rank[i]
            else:  # greedy: the top-1 (top_lps has a column even for logprobs 0)
                lp, rk = top_lps_l[i][0], 1
            out.append((tokens_l[i], TokenLogprob(
                tokens_l[i], lp, rk, top, [(t, in_top.get(t, v)) for t, v in extra.get(i, [])],
                mass.get(i))))
        return out

    def prompt_logprobs(self, logits: torch.Tensor, target_ids: Seq[int], k: int
                        ) -> list[TokenLogprob]:
        """logits [N, V] at positions q; target_ids[n] = the prompt token at q+1."""
        if logits.shape[0] == 0:
            return []
        top_ids, top_lps, lse = ops.topk_logprobs(logits, max(k, 1), None, None)
        tgt = torch.tensor(list(target_ids), device=logits.device)
        val = logits.float().gather(1, tgt[:, None])                          # [N, 1]
        lp = (val[:, 0] - lse).tolist()
        rank = ((logits > val).sum(-1) + 1).tolist()
        ti, tl = top_ids.tolist(), top_lps.tolist()
        out = []
        for n, t in enumerate(target_ids):
            top = [(a, b) for a, b in zip(ti[n][:k], tl[n][:k]) if a >= 0 and b != _NEG_INF]
            out.append(TokenLogprob(int(t), dict(top).get(int(t), lp[n]), rank[n], top))
        return out


def _apply_penalties_subset(logits: torch.Tensor, rows: Seq[SampleRow], local: Seq[int]) -> None:
    if not any(r.params.has_penalties for r in rows):
        return
    view = logits[list(local)]
    _apply_penalties(view, rows)
    logits[list(local)] = view
