"""The Llama forward's elementwise ops, fused on the CPU extension (csrc/elementwise/) for fp32 and
bf16, each with its pure-torch twin here (the torch code model/llama.py had, op for op: the same
intermediate roundings, so the results are bitwise equal; tests/unit/test_elementwise.py).

    rms_norm(x, weight, eps, residual=None) -> y | (y, residual)
    silu_mul(gate_up, intermediate_size) -> act;  rope_(q, k, cos, sin) (in place)
    fused_elementwise_available(x)

No autograd. Not the matmuls (linear.py) or attention (attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from freetoken.ops.backend import _C, backend_for

_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)


def fused_elementwise_available(x: torch.Tensor) -> bool:
    """True when rms_norm / silu_mul / rope_ on x run the extension's fused kernel: x on a
    device the extension serves on the CPU ("ext-cpu") and x fp32 or bf16. No autograd."""
    return x.dtype in _ELEMENTWISE_DTYPES and backend_for(x.device) == "ext-cpu"


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
