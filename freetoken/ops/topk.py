"""The one seam between FreeToken and its compiled kernel, freetoken._C (the only importer).

    topk_logprobs(logits, k, allowed=None, logit_bias=None) -> (ids, logprobs, lse)
    sample_tokens(logits, allowed, logit_bias, temperature, top_k, top_p, min_p, seed, step)
    backend() / backend_for(device) -> "ext-cpu" | "ext-cuda" | "torch"
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window)
      (CPU ext)  paged_attention_available(device, dtype)
    rms_norm(x, weight, eps, residual=None) -> y | (y, residual)   fused_elementwise_available(x)
    silu_mul(gate_up, intermediate_size) -> act;  rope_(q, k, cos, sin) (in place)
      (the Llama forward's elementwise ops: fused on the CPU ext for fp32/bf16, else the twin)
    pack_panels(weight) -> packed;  panel_linear(x, packed, bias=None) -> x @ W^T (+ bias)
      panel_linear_available(x), panel_shape(packed) -> (N, K)  (CPU ext only, fp32 or bf16, no
      twin: the small-M decode linear over weights packed once; see csrc/linear_cpu.cpp)
    pack_gguf_panels(rows, type, in_features) -> packed: GGUF Q4_1 / Q8_0 blocks for
      panel_linear with fp32 x, dequantized exactly in registers (csrc/quant_linear_cpu.cpp)

Per row r of logits [B, V] (fp32/bf16/fp16), with x(t) = logit(t) + bias(t) computed in fp32:
  * the row's *set* is its allowed ids (duplicates count once), or the whole vocabulary when its
    range of `allowed` is empty;
  * lse[r] = log sum_{t in set} exp x(t); logprob(t) = x(t) - lse[r] for any t in the set;
  * ids/logprobs [B, k] are the top k of the set by (x desc, id asc), padded with -1 / -inf.
NaN or +inf among the set's logits, or a set whose logits are all -inf, raise RuntimeError
("... row R has NaN logits"). Bad ids/offsets raise ValueError before any kernel runs.

Compact per-row lists: allowed = (offsets int32 [B+1], ids int32 [N]); logit_bias = (offsets,
ids, values fp32 [N]); row r owns entries offsets[r]:offsets[r+1]; duplicate bias ids add up.

FREETOKEN_OPS=auto (default: the extension where it supports the device, else the torch twin)
| ext (the extension or an error) | torch (always the twin). The twin below gives the same ids
and logprobs within float rounding; tests/test_ops.py holds both to an fp64 reference.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F  # noqa: N812

log = logging.getLogger(__name__)

MAX_K = 64

_MODE = (os.environ.get("FREETOKEN_OPS", "auto").strip().lower() or "auto")
if _MODE not in ("auto", "ext", "torch"):
    raise ValueError(f"FREETOKEN_OPS must be auto, ext or torch, got {_MODE!r}")

try:
    from freetoken import _C  # noqa: N813
    _IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # a pure-Python install, or a broken build: the twin takes over
    _C = None
    _IMPORT_ERROR = exc

if _MODE == "ext" and _C is None:
    raise ImportError(f"FREETOKEN_OPS=ext but freetoken._C does not import: {_IMPORT_ERROR}")

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# backend choice


def backend_for(device: torch.device | str) -> str:
    """Which implementation serves tensors on `device`: "ext-cpu", "ext-cuda" or "torch"."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _backend_for_type(kind)


@functools.cache
def _backend_for_type(kind: str) -> str:
    name = "torch"
    if _MODE != "torch" and _C is not None:
        if kind == "cpu":
            name = "ext-cpu"
        elif kind == "cuda" and _C.cuda_compiled():
            name = "ext-cuda"
        elif _MODE == "ext":
            raise RuntimeError(f"FREETOKEN_OPS=ext but freetoken._C has no kernel for {kind}")
    _log_choice(name, kind)
    return name


def backend() -> str:
    """The backend for CPU tensors (what `python -c "import freetoken.ops as o; ..."` shows)."""
    return backend_for("cpu")


@functools.cache
def _log_choice(name: str, device_type: str) -> None:
    if name == "torch" and _C is None:
        log.info("freetoken.ops: %s tensors use the torch twin (freetoken._C: %s)",
                 device_type, _IMPORT_ERROR)
    elif name == "ext-cpu":
        log.info("freetoken.ops: cpu tensors use freetoken._C (%s kernel)", _C.cpu_isa())
    else:
        log.info("freetoken.ops: %s tensors use %s (FREETOKEN_OPS=%s)", device_type, name, _MODE)


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


def topk_logprobs(logits: torch.Tensor, k: int, allowed=None, logit_bias=None):
    """-> ids int64 [B, k], logprobs fp32 [B, k], lse fp32 [B]; see the module docstring."""
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
        return _topk_logprobs_torch(logits, k, allowed, logit_bias)
    a = allowed or (None, None)
    b = logit_bias or (None, None, None)
    out = _C.topk_logprobs(logits.contiguous(), k, *a, *b)
    if name == "ext-cuda":
        ids, lps, lse, status = out
        if bool(status.any()):
            r = int(status.nonzero()[0, 0])
            _raise_row("topk_logprobs", r, int(status[r]))
        return ids, lps, lse
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


def _masked_biased(fn: str, logits: torch.Tensor, allowed, logit_bias):
    """-> (xm fp32 [B, V]: logit + bias, -inf outside the set; member bool [B, V] or None).

    Raises on NaN / +inf in the set or an all -inf set, in the kernel's order and words."""
    B, V = logits.shape
    x = logits.float()
    if logit_bias is not None and logit_bias[1].numel():
        bo, bi, bv = logit_bias
        dense = torch.zeros(B, V, dtype=torch.float32, device=logits.device)
        dense.index_put_((_rows_of(bo, B), bi.long()), bv, accumulate=True)
        x = x + dense  # the kernel adds the summed bias too: logit + (b1 + b2)
    member = None
    if allowed is not None and allowed[1].numel():
        ao, ai = allowed
        member = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
        member[_rows_of(ao, B), ai.long()] = True
        member |= (ao[1:] == ao[:-1])[:, None]  # an empty range: no mask on that row
        x = x.masked_fill(~member, _NEG_INF)
    flags = (torch.isnan(x).any(-1).int() * _FLAG_NAN
             | (x == float("inf")).any(-1).int() * _FLAG_POSINF
             | (x.amax(-1) == _NEG_INF).int() * _FLAG_ALLNEG)
    if bool(flags.any()):
        r = int(flags.nonzero()[0, 0])
        _raise_row(fn, r, int(flags[r]))
    return x, member


def _topk_logprobs_torch(logits, k, allowed, logit_bias):
    """The pure-torch twin: mask fill, fp32 logsumexp, top-k with ties to the lower id."""
    B, V = logits.shape
    dev = logits.device
    xm, member = _masked_biased("topk_logprobs", logits, allowed, logit_bias)
    lse = torch.logsumexp(xm, dim=-1)
    ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    lps = torch.full((B, k), _NEG_INF, dtype=torch.float32, device=dev)
    if k == 0 or B == 0:
        return ids, lps, lse
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
    return ids, lps, lse


# ---------------------------------------------------------------------------------------------
# sample_tokens: one torch implementation for every backend


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


__all__ = ["MAX_K", "backend", "backend_for", "fused_elementwise_available", "gumbel_noise",
           "rms_norm", "rope_", "sample_tokens", "silu_mul", "topk_logprobs"]


# ---------------------------------------------------------------------------------------------
# paged attention for any number of query tokens per sequence (CPU)

_HAS_PAGED_ATTENTION = _C is not None and hasattr(_C, "paged_attention")  # False: stale build
_PAGED_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_attention_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when freetoken._C serves paged_attention for `dtype` tensors on `device` (the CPU
    extension in use, fp32 / bf16 / fp16); otherwise freetoken/model/attention.py keeps its torch
    path (gather + SDPA), which is also this kernel's reference in tests/test_attention.py."""
    return (dtype in _PAGED_ATTENTION_DTYPES and _HAS_PAGED_ATTENTION
            and backend_for(device) == "ext-cpu")


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
    if not _HAS_PAGED_ATTENTION:
        why = _IMPORT_ERROR if _C is None else "this build has no paged_attention (rebuild it)"
        raise RuntimeError(f"paged_attention needs freetoken._C: {why}")
    return _C.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              float(scale), int(window or 0), k, v, slot_mapping)


# ---------------------------------------------------------------------------------------------
# fused elementwise ops of the Llama forward (CPU ext); each twin is llama.py's torch code

_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)
_HAS_ELEMENTWISE = _C is not None and hasattr(_C, "rope_")  # False for a stale build


def fused_elementwise_available(x: torch.Tensor) -> bool:
    """True when rms_norm / silu_mul / rope_ on x run the extension's fused kernel: x on a
    device the extension serves on the CPU ("ext-cpu") and x fp32 or bf16. No autograd."""
    return (x.dtype in _ELEMENTWISE_DTYPES and _HAS_ELEMENTWISE
            and backend_for(x.device) == "ext-cpu")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x [T, H] (rows contiguous), weight [H] (x's dtype or fp32) ->
    weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype), in torch's promotion
    of weight and x (the normalised value is rounded to x's dtype before the weight, as HF does).

    With residual [T, H] (x's dtype): residual += x IN PLACE (rounded like x + residual), and
    returns (rms_norm(residual), residual), the same tensor object. x is not modified."""
    if fused_elementwise_available(x):
        if residual is None:
            return _C.rms_norm(x, weight, eps)
        return _C.add_rms_norm(x, residual, weight, eps), residual
    return _rms_norm_torch(x, weight, eps, residual)


def _rms_norm_torch(x, weight, eps, residual=None):
    if residual is not None:
        residual.add_(x)  # bitwise x + residual (llama.py's `x = x + h`), kept in place
        return _rms_norm_torch(residual, weight, eps), residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def silu_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """gate_up [T, 2I] -> F.silu(gate_up[:, :I]) * gate_up[:, I:], [T, I] in gate_up's dtype
    (silu rounded to the dtype, then the product)."""
    if fused_elementwise_available(gate_up):
        return _C.silu_mul(gate_up, intermediate_size)
    return _silu_mul_torch(gate_up, intermediate_size)


def _silu_mul_torch(gate_up, intermediate_size):
    gate, up = gate_up.split(intermediate_size, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, on every head: x <- x * cos + rotate_half(x) * sin, rotate_half(x) =
    cat(-x[hd/2:], x[:hd/2]), each op rounded to the dtype as torch does. q [T, nh, hd],
    k [T, kvh, hd] with stride(2) == 1 and stride(1) == hd (views into one fused qkv output are
    fine); cos, sin [T, hd] or [T, 1, hd] in q's dtype."""
    if fused_elementwise_available(q):
        _C.rope_(q, k, cos, sin)
    else:
        _rope_torch_(q, k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_torch_(q, k, cos, sin):
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, hd]
    q.copy_(q * cos + _rotate_half(q) * sin)
    k.copy_(k * cos + _rotate_half(k) * sin)


# ---------------------------------------------------------------------------------------------
# the panel linear (CPU ext, fp32/bf16): y = x @ W^T (+ bias) over W packed once, for decode

_HAS_PANEL = _C is not None and hasattr(_C, "panel_linear")  # False for a stale build
_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def panel_linear_available(x: torch.Tensor) -> bool:
    """True when panel_linear serves x: the extension is built with it, x is on a device it
    serves on the CPU ("ext-cpu") and x is fp32 or bf16. There is no torch twin for the packed
    format; callers keep their own path (freetoken/model/linear.py) where this is False."""
    return x.dtype in _PANEL_DTYPES and _HAS_PANEL and backend_for(x.device) == "ext-cpu"


def _need_panel(fn: str) -> None:
    if not _HAS_PANEL:
        why = _IMPORT_ERROR if _C is None else "this build has no panel_linear (rebuild it)"
        raise RuntimeError(f"{fn} needs freetoken._C: {why}")


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 or bf16 CPU -> packed: a 1-D tensor of its dtype, a 64-byte header
    (int32 words: magic, version, N, K, 16, number of panels, dtype) then ceil(N / 16) panels
    [K, 16], panel p holding W[16p:16p+16, :].T with rows >= N zero. Opaque to everything but
    panel_linear / panel_shape; it survives clone(), torch.save and nn.Parameter (the header
    travels with the data)."""
    _need_panel("pack_panels")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or weight.dtype not in _PANEL_DTYPES or weight.device.type != "cpu":
        raise ValueError("pack_panels: weight must be a 2-D fp32 or bf16 CPU tensor [N, K]")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"pack_panels: weight must not be empty, got {tuple(weight.shape)}")
    return _C.panel_pack(weight.detach())


GGUF_PANEL_TYPES = ("Q4_1", "Q8_0")
_GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # per 32 weights in the GGUF file


def pack_gguf_panels(rows: torch.Tensor, type: str, in_features: int) -> torch.Tensor:  # noqa: A002
    """A weight W [N, K] as its GGUF file stores it (rows [N, K / 32 * block bytes] uint8 of
    `type`, one of GGUF_PANEL_TYPES) -> packed panels (1-D uint8, the pack_panels header with
    dtype 2 / 3) for panel_linear with fp32 x. Each weight is dequantized in registers to exactly
    the fp32 value gguf.quants.dequantize gives (csrc/quant_linear_cpu.cpp)."""
    _need_panel("pack_gguf_panels")
    if type not in GGUF_PANEL_TYPES:
        raise ValueError(f"pack_gguf_panels: type must be one of {GGUF_PANEL_TYPES}, got {type!r}")
    if not isinstance(in_features, int) or in_features < 32 or in_features % 32:
        raise ValueError(f"pack_gguf_panels: in_features must be a positive multiple of 32, "
                         f"got {in_features!r}")
    row_bytes = in_features // 32 * _GGUF_BLOCK_BYTES[type]
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2 \
            or rows.device.type != "cpu" or rows.shape[0] == 0 or rows.shape[1] != row_bytes:
        raise ValueError(f"pack_gguf_panels: rows must be a uint8 CPU tensor [N >= 1, "
                         f"{row_bytes}] ({type} blocks of {in_features} weights)")
    return _C.gguf_pack(rows, type, in_features)


def gguf_panel_type(packed: torch.Tensor) -> str | None:
    """"Q4_1" / "Q8_0" for a tensor from pack_gguf_panels, None for one from pack_panels."""
    if packed.dtype != torch.uint8:
        return None
    panel_shape(packed)  # checks the header
    return GGUF_PANEL_TYPES[int(packed[24]) - 2]  # header word 6, little-endian


def panel_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a tensor from pack_panels or pack_gguf_panels (checks its header)."""
    _need_panel("panel_shape")
    n, k = _C.panel_shape(packed)
    return n, k


def panel_linear(x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] contiguous, of the packed weight's dtype (fp32 for GGUF blocks) -> x @ W^T
    (+ bias [N], same dtype) [..., N] in that dtype, W = the weight that `packed` came from.
    fp32 sums (within fp32 rounding of x.double() @ W.double().T; bf16: that, rounded once);
    fastest for few rows
    (decode), correct for any. Raises ValueError on a bad x, bias or packed, RuntimeError
    without the extension. No autograd."""
    _need_panel("panel_linear")
    # NOTE: the C++ side checks everything; the Python checks run only once it has refused, to
    # name the problem as a ValueError. Checking first cost 4 us a call (a 1.3 MB weight: 60 us).
    try:
        if x.dim() == 2:
            return _C.panel_linear(x, packed, bias)
        y = _C.panel_linear(x.view(-1, x.shape[-1]), packed, bias)    # [M, N]
        return y.view(*x.shape[:-1], y.shape[-1])
    except Exception:
        _check_panel_args(x, packed, bias)
        raise


def _check_panel_args(x, packed, bias) -> None:
    if not isinstance(packed, torch.Tensor):
        raise ValueError("panel_linear: packed must be the tensor from pack_panels")
    try:
        n, k = panel_shape(packed)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    dtype = torch.float32 if packed.dtype == torch.uint8 else packed.dtype  # GGUF blocks: fp32
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.dtype != dtype \
            or x.device.type != "cpu":
        raise ValueError(f"panel_linear: x must be a CPU tensor [..., K] of the weight's dtype "
                         f"({dtype})")
    if x.shape[-1] != k:
        raise ValueError(f"panel_linear: x has K = {x.shape[-1]}, the packed weight has K = {k}")
    if not x.is_contiguous():
        raise ValueError("panel_linear: x must be contiguous (a copy would hide its cost)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != dtype
                             or tuple(bias.shape) != (n,) or bias.device.type != "cpu"
                             or not bias.is_contiguous()):
        raise ValueError(f"panel_linear: bias must be a contiguous CPU tensor [{n}] of the "
                         f"weight's dtype ({dtype})")


# ---------------------------------------------------------------------------------------------
# one decoder layer in one call (CPU ext): the fused ops above, chained in C++

_HAS_DECODER_LAYER = _C is not None and hasattr(_C, "DecoderLayer")  # False for a stale build


def decoder_layer_available(x: torch.Tensor) -> bool:
    """True when decoder_layer serves a model whose activations are like x: the extension's
    fused elementwise ops, panel linears and paged attention all serve x's dtype and device."""
    return (_HAS_DECODER_LAYER and fused_elementwise_available(x) and panel_linear_available(x)
            and paged_attention_available(x.device, x.dtype))


def decoder_layer(input_norm: torch.Tensor, post_norm: torch.Tensor,
                  weights: list[torch.Tensor | None], few_rows: list[torch.Tensor | None],
                  biases: list[torch.Tensor | None], *, num_heads: int, num_kv_heads: int,
                  head_dim: int, intermediate_size: int, eps: float, scale: float,
                  window: int | None, few_rows_max: int):
    """One Llama decoder layer as one C++ call (csrc/decoder_layer_cpu.cpp): rms_norm /
    add_rms_norm, panel_linear, rope_, paged_attention and silu_mul in DecoderLayer.forward's
    order, with the same results. weights / few_rows / biases: 4 each (qkv, o, gate_up, down),
    None where absent: the main forms from pack_panels (None where the main form is not panels),
    the forms for steps of at most few_rows_max rows (pack_gguf_panels, bf16 pack_panels).
    -> an object with .serves(rows) -> bool and .forward(x, residual, cos, sin, k_cache,
    v_cache, block_tables, seq_lens, query_start_loc, slot_mapping) -> (out, residual), the
    arguments as for the ops it chains. Raises ValueError on misshapen weights."""
    if not _HAS_DECODER_LAYER:
        why = _IMPORT_ERROR if _C is None else "this build has no DecoderLayer (rebuild it)"
        raise RuntimeError(f"decoder_layer needs freetoken._C: {why}")
    return _C.DecoderLayer(input_norm, post_norm, list(weights), list(few_rows), list(biases),
                           num_heads, num_kv_heads, head_dim, intermediate_size, float(eps),
                           float(scale), int(window or 0), int(few_rows_max))
