"""sample_tokens: one token id per row from the masked, biased logits, with temperature, top_k,
top_p and min_p, and the counter-based Gumbel noise that makes a (seed, step) pair draw the same
token on every backend.

One torch implementation serves every backend (it is its own twin): the work is a few dense
passes that torch already runs well, and the noise must be the same bits on CPU and GPU. It
shares topk.py's checks and its mask / bias / error rules. Not top-k logprobs (topk.py).
"""

from __future__ import annotations

import torch

from freetoken.ops.topk import _NEG_INF, _check_compact, _check_logits, _masked_biased

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _i64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


_M1, _M2, _G = _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB), _i64(_GOLDEN)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise, fp64, for (seed, step, token id) triples (broadcast).

    u = (top 24 bits of mix(mix(mix(seed ^ G) + step) + id * G) + 0.5) / 2^24, g = -log(-log u):
    integer hashing, then two fp64 logs, so every device draws the same noise."""
    s = _splitmix(_splitmix(seed.long() ^ _G) + step.long())
    h = _splitmix(s + token_ids.long() * _G)
    u = (_srl(h, 40).double() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


# Noise is within [-log(-log(2^-25)), -log(-log(1 - 2^-25))] = [-2.86, 17.33]: a token whose
# scaled logit is more than 20.2 below the row's best can never win the race, so it gets none.
_PRUNE = 21.0


def _nucleus(zk: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """top_p membership [S, V] for scaled logits zk [S, V] fp64 (-inf = filtered out): the
    smallest prefix of the ranking (z desc, id asc) whose mass reaches tp, found with top-c
    values for growing c (the values, unlike tie order, are unambiguous), so the usual cost is
    one topk(64), not a sort of V."""
    S, V = zk.shape
    lse = torch.logsumexp(zk, dim=-1, keepdim=True)                     # [S, 1]
    c = min(64, V)
    while True:
        vals = torch.topk(zk, c, dim=-1).values                         # [S, c] desc
        p = torch.exp(vals - lse)
        before = torch.cumsum(p, -1) - p                                 # mass ranked above
        inside = (before < tp[:, None]) & (vals > _NEG_INF)
        size = inside.sum(-1)                                            # [S], >= 1
        done = (size < c) | (tp >= 1)
        if bool(done.all()) or c == V:
            break
        c = min(V, 4 * c)
    size = size.clamp(min=1)
    cut = vals.gather(1, (size - 1)[:, None])                            # [S, 1]
    n_gt = (vals > cut).sum(-1, keepdim=True)
    eq = zk == cut
    out = (zk > cut) | (eq & (eq.cumsum(-1) <= size[:, None] - n_gt))    # ties: lower ids
    return out | (tp >= 1)[:, None]


def sample_tokens(logits: torch.Tensor, allowed, logit_bias, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One token id per row (int64 [B]) from the masked, biased distribution / temperature.

    temperature [B] fp32 (0 = greedy: the top id of topk_logprobs, ties to the lower id);
    top_k [B] int32 (-1 or 0 = off; keeps tokens >= the k-th largest value); top_p [B] fp32
    (1 = off; the smallest most-likely prefix, after top_k, whose mass reaches top_p); min_p [B]
    fp32 (0 = off; keeps p >= min_p * p_max); seed, step [B] int64. Gumbel-max over
    gumbel_noise(seed, step, id): the same (seed, step) gives the same token on every backend.
    """
    _check_logits("sample_tokens", logits)
    B, V = logits.shape
    dev = logits.device
    allowed = _check_compact("allowed", allowed, B, V, dev, False)
    logit_bias = _check_compact("logit_bias", logit_bias, B, V, dev, True)

    def per_row(name, t, dtype):
        t = torch.as_tensor(t, device=dev).to(dtype)
        if t.shape != (B,):
            raise ValueError(f"sample_tokens: {name} must have shape [{B}], got {tuple(t.shape)}")
        return t

    temperature = per_row("temperature", temperature, torch.float32)
    top_k = per_row("top_k", top_k, torch.int64)
    top_p = per_row("top_p", top_p, torch.float32)
    min_p = per_row("min_p", min_p, torch.float32)
    seed = per_row("seed", seed, torch.int64)
    step = per_row("step", step, torch.int64)
    if B and not bool(((temperature >= 0) & (top_p > 0) & (top_p <= 1)
                       & (min_p >= 0) & (min_p <= 1)).all()):
        raise ValueError("sample_tokens: need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)

    xm, member = _masked_biased("sample_tokens", logits, allowed, logit_bias)
    out = torch.argmax(xm, dim=-1)  # greedy: the first (lowest) id of the maximum
    rows = (temperature > 0).nonzero(as_tuple=True)[0]
    if rows.numel() == 0:
        return out
    x = xm[rows]                                                        # [S, V] fp32
    t64 = temperature[rows].double()
    keep = x > _NEG_INF
    tk = top_k[rows]
    tk_on = (tk > 0) & (tk < V)
    if bool(tk_on.any()):
        kmax = int(tk[tk_on].max())
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (tk.clamp(1, kmax) - 1)[:, None])
        keep &= (x >= kth) | ~tk_on[:, None]
    z = x.double() / t64[:, None]                                       # [S, V] fp64
    zmax = z.amax(-1)                                                   # always kept
    cand = keep & (z >= (zmax - _PRUNE)[:, None])
    r, c = cand.nonzero(as_tuple=True)                                  # r asc, then c asc
    zc = z[r, c]
    ok = torch.ones_like(zc, dtype=torch.bool)
    mp = min_p[rows].double()
    ok &= (zc - zmax[r]) >= torch.log(mp)[r]                            # log 0 = -inf: off
    tp = top_p[rows].double()
    if bool((tp < 1).any()):
        ok &= _nucleus(z.masked_fill(~keep, _NEG_INF), tp)[r, c]
    key = torch.where(ok, zc + gumbel_noise(seed[rows][r], step[rows][r], c), _NEG_INF)
    best = torch.full((rows.numel(),), _NEG_INF, dtype=key.dtype, device=dev)
    best = best.scatter_reduce(0, r, key, reduce="amax")
    win = torch.where(key == best[r], c, V)
    pick = torch.full((rows.numel(),), V, dtype=torch.int64, device=dev)
    pick = pick.scatter_reduce(0, r, win, reduce="amin")
    out[rows] = pick
    return out
