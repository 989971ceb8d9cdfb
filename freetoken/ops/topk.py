"""topk_logprobs: the fused mask / logit-bias / log-softmax / top-k of the sampler, on
freetoken._C (csrc/topk/, csrc/cuda/) or its pure-torch twin, and the checks of its compact
per-row lists (which sample_tokens shares).

    topk_logprobs(logits, k, allowed=None, logit_bias=None, full_lse=False)
        -> (ids, logprobs, lse), or (ids, logprobs, lse, full) with full_lse

Per row r of logits [B, V] (fp32/bf16/fp16), with x(t) = logit(t) + bias(t) computed in fp32:
  * the row's *set* is its allowed ids (duplicates count once), or the whole vocabulary when its
    range of `allowed` is empty;
  * lse[r] = log sum_{t in set} exp x(t); logprob(t) = x(t) - lse[r] for any t in the set;
  * ids/logprobs [B, k] are the top k of the set by (x desc, id asc), padded with -1 / -inf;
  * full[r] = log sum_{t < V} exp x(t), the unmasked lse (from the same pass over the row), so
    lse[r] - full[r] is the log of the mass the whole distribution puts on the set (equal to lse
    on a row without a set; NaN / +inf when a logit outside the set is NaN / +inf).
NaN or +inf among the set's logits, or a set whose logits are all -inf, raise RuntimeError
("... row R has NaN logits"). Bad ids/offsets raise ValueError before any kernel runs.

Compact per-row lists: allowed = (offsets int32 [B+1], ids int32 [N]); logit_bias = (offsets,
ids, values fp32 [N]); row r owns entries offsets[r]:offsets[r+1]; duplicate bias ids add up.

The twin gives the same ids and logprobs within float rounding; tests/unit/test_ops.py holds both to
an fp64 reference. Which one runs: freetoken/ops/backend.py. Not sampling (sampling.py).
"""

from __future__ import annotations

import torch

from freetoken.ops.backend import _C, backend_for

MAX_K = 64

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# validation (before any kernel)


def _check_logits(fn: str, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{fn}: logits must be a [B, V] tensor")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{fn}: logits must be fp32, bf16 or fp16, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError(f"{fn}: the vocabulary is empty")


def _as(t, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device \
            and t.is_contiguous():
        return t
    t = torch.as_tensor(t, device=device)
    if dtype != torch.float32 and t.dtype.is_floating_point:
        raise ValueError("offsets and ids must be integer tensors")
    return t.to(dtype).contiguous()


def _check_compact(what: str, comp, B: int, V: int, device: torch.device, with_values: bool,
                   use_ext: bool = True):
    """Validates one compact per-row list; returns its tensors as int32/fp32 on `device`.

    On the CPU with the extension the checks run in one C++ call (freetoken._C.check_compact);
    _check_compact_py is the same checks, word for word, for the twin and for GPU tensors."""
    if comp is None:
        return None
    n_parts = 3 if with_values else 2
    if not isinstance(comp, (tuple, list)) or len(comp) != n_parts:
        raise ValueError(f"{what} must be a tuple of {n_parts} tensors "
                         f"(offsets, ids{', values' if with_values else ''})")
    try:
        offsets = _as(comp[0], torch.int32, device)
        ids = _as(comp[1], torch.int32, device)
        values = _as(comp[2], torch.float32, device) if with_values else None
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if use_ext and _C is not None and device.type == "cpu":
        msg = _C.check_compact(offsets, ids, values, B, V)
    else:
        msg = _check_compact_py(offsets, ids, values, B, V)
    if msg:
        raise ValueError(f"{what}: {msg}")
    return (offsets, ids, values) if with_values else (offsets, ids)


def _check_compact_py(offsets, ids, values, B: int, V: int) -> str:
    if offsets.dim() != 1 or offsets.shape[0] != B + 1:
        return f"offsets must have B+1 = {B + 1} entries, got {offsets.numel()}"
    if ids.dim() != 1:
        return "ids must be 1-D"
    n = ids.shape[0]
    off = offsets.tolist()
    if off[0] != 0 or off[-1] != n:
        return f"offsets must run from 0 to len(ids) = {n}, got {off[0]}..{off[-1]}"
    for r in range(B):
        if off[r + 1] < off[r]:
            return f"offsets must not decrease (row {r}: {off[r]} > {off[r + 1]})"
    if n:
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= V:
            bad = int(((ids < 0) | (ids >= V)).nonzero()[0, 0])
            row = next(r for r in range(B) if off[r] <= bad < off[r + 1])
            return (f"ids[{bad}] = {int(ids[bad])} (row {row}) is outside the "
                    f"vocabulary (0..{V - 1})")
    if values is not None:
        if values.dim() != 1 or values.shape[0] != n:
            return f"values must match ids, got {values.numel()} for {n}"
        if n and not bool(torch.isfinite(values).all()):
            return f"values[{int((~torch.isfinite(values)).nonzero()[0, 0])}] is not finite"
    return ""


# ---------------------------------------------------------------------------------------------
# topk_logprobs


def topk_logprobs(logits: torch.Tensor, k: int, allowed=None, logit_bias=None,
                  full_lse: bool = False):
    """-> ids int64 [B, k], logprobs fp32 [B, k], lse fp32 [B] (+ full fp32 [B] with full_lse);
    see the module docstring."""
    _check_logits("topk_logprobs", logits)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
        raise ValueError(f"topk_logprobs: k must be an int in 0..{MAX_K}, got {k!r}")
    B, V = logits.shape
    allowed = _check_compact("allowed", allowed, B, V, logits.device, False)
    logit_bias = _check_compact("logit_bias", logit_bias, B, V, logits.device, True)
    name = backend_for(logits.device)
    if name == "ext-cuda" and k and V > (4096 // k) * 4096:
        name = "torch"  # the CUDA merge holds (V / 4096) * k candidates: at most 4096
    if name == "torch":
        return _topk_logprobs_torch(logits, k, allowed, logit_bias, full_lse)
    a = allowed or (None, None)
    b = logit_bias or (None, None, None)
    out = _C.topk_logprobs(logits.contiguous(), k, *a, *b, full_lse)
    if name == "ext-cuda":
        *out, status = out
        if bool(status.any()):
            r = int(status.nonzero()[0, 0])
            _raise_row("topk_logprobs", r, int(status[r]))
    return tuple(out)


_FLAG_NAN, _FLAG_POSINF, _FLAG_ALLNEG = 1, 2, 4


def _raise_row(fn: str, r: int, flags: int):
    if flags & _FLAG_NAN:
        raise RuntimeError(f"{fn}: row {r} has NaN logits")
    if flags & _FLAG_POSINF:
        raise RuntimeError(f"{fn}: row {r} has a +inf logit")
    raise RuntimeError(f"{fn}: row {r} has logit -inf for every token of its set")


def _rows_of(offsets: torch.Tensor, B: int) -> torch.Tensor:
    counts = (offsets[1:] - offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(B, device=offsets.device), counts)


def _masked_biased(fn: str, logits: torch.Tensor, allowed, logit_bias, unmasked: bool = False):
    """-> (xm fp32 [B, V]: logit + bias, -inf outside the set; member bool [B, V] or None), plus
    x (logit + bias, no mask) when `unmasked`.

    Raises on NaN / +inf in the set or an all -inf set, in the kernel's order and words."""
    B, V = logits.shape
    x = logits.float()
    if logit_bias is not None and logit_bias[1].numel():
        bo, bi, bv = logit_bias
        dense = torch.zeros(B, V, dtype=torch.float32, device=logits.device)
        dense.index_put_((_rows_of(bo, B), bi.long()), bv, accumulate=True)
        x = x + dense  # the kernel adds the summed bias too: logit + (b1 + b2)
    member = None
    xm = x
    if allowed is not None and allowed[1].numel():
        ao, ai = allowed
        member = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
        member[_rows_of(ao, B), ai.long()] = True
        member |= (ao[1:] == ao[:-1])[:, None]  # an empty range: no mask on that row
        xm = x.masked_fill(~member, _NEG_INF)
    flags = (torch.isnan(xm).any(-1).int() * _FLAG_NAN
             | (xm == float("inf")).any(-1).int() * _FLAG_POSINF
             | (xm.amax(-1) == _NEG_INF).int() * _FLAG_ALLNEG)
    if bool(flags.any()):
        r = int(flags.nonzero()[0, 0])
        _raise_row(fn, r, int(flags[r]))
    return (xm, member, x) if unmasked else (xm, member)


def _topk_logprobs_torch(logits, k, allowed, logit_bias, full_lse=False):
    """The pure-torch twin: mask fill, fp32 logsumexp, top-k with ties to the lower id."""
    B, V = logits.shape
    dev = logits.device
    xm, member, x = _masked_biased("topk_logprobs", logits, allowed, logit_bias, unmasked=True)
    lse = torch.logsumexp(xm, dim=-1)
    tail = ()
    if full_lse:  # NaN / +inf outside the set are no error here: logsumexp carries them on
        tail = (torch.logsumexp(x, dim=-1) if member is not None else lse.clone(),)
    ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    lps = torch.full((B, k), _NEG_INF, dtype=torch.float32, device=dev)
    if k == 0 or B == 0:
        return ids, lps, lse, *tail
    kk = min(k, V)
    count = member.sum(-1) if member is not None else torch.full((B,), V, device=dev)
    keff = count.clamp(max=kk)                                            # [B], >= 1
    vals = torch.topk(xm, kk, dim=-1).values                              # [B, kk]
    thr = vals.gather(1, (keff - 1)[:, None])                             # [B, 1]
    gt = xm > thr
    eq = xm == thr
    if member is not None:
        eq &= member
    need = keff - gt.sum(-1)                                              # [B]
    sel = gt | (eq & (eq.cumsum(-1) <= need[:, None]))                    # keff per row
    r, c = sel.nonzero(as_tuple=True)                                     # row-major: ids asc
    start = torch.cumsum(keff, 0) - keff
    slot = torch.arange(r.shape[0], device=dev) - start[r]
    out_ids = torch.full((B, kk), -1, dtype=torch.int64, device=dev)
    out_v = torch.full((B, kk), _NEG_INF, dtype=torch.float32, device=dev)
    out_ids[r, slot] = c
    out_v[r, slot] = xm[r, c]
    # value desc; equal values keep their id-ascending slots, pads stay behind real -inf values
    order = torch.sort(out_v, dim=-1, descending=True, stable=True).indices
    out_v = out_v.gather(1, order)
    out_ids = out_ids.gather(1, order)
    out_lp = torch.where(out_ids >= 0, out_v - lse[:, None], _NEG_INF)
    ids[:, :kk] = out_ids
    lps[:, :kk] = out_lp
    return ids, lps, lse, *tail

