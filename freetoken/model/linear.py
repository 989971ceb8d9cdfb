"""The model's linear layers: oneDNN with pre-packed weights on CPU, F.linear everywhere else.

Why: torch's CPU F.linear calls MKL sgemm, which on this project's AMD EPYC machines is 1.2-3.2x
slower than oneDNN with the weight reordered once into its blocked layout (decode's skinny
matmuls gain most: 8 rows x 3072x576 fp32, 1.06 -> 0.38 ms; see docs/benchmarks.md). Both are
fp32 GEMMs; they differ in summation order only (~1e-4 on a logit).

The packed weight replaces the plain one (no second copy): `weight` becomes an opaque mkldnn
tensor (same shape and numel; `weight.to_dense()` gives the plain matrix back).
FREETOKEN_LINEAR=torch keeps F.linear (the A/B switch for benchmarks and a way out).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(weight: torch.Tensor) -> bool:
    """True when `weight` can be served by oneDNN's packed linear here."""
    return (
        os.environ.get("FREETOKEN_LINEAR", "auto") != "torch"
        and weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> the same matrix in oneDNN's blocked layout (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., in] -> [..., out], by whichever form `weight` is in."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """nn.Linear's parameters (`weight` [out, in], optional `bias`), forward through `linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def pack(self) -> bool:
        """Reorder the weight for oneDNN in place of the plain one; False where not available."""
        if self.weight.is_mkldnn or not packing_available(self.weight):
            return self.weight.is_mkldnn
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True
