"""The model's linear layers, by the form their weight was packed into at load:

  * fp32 on the CPU with freetoken._C: panels (ops.pack_panels / ops.panel_linear,
    csrc/linear_cpu.cpp), a layout that streams each weight once per call. Decode steps are
    weight-bandwidth bound and oneDNN read cold weights at half the rate (a decode step's
    linears at 8 rows: 43.7 -> 22.8 ms); at 224 rows (a batched prefill) the two are level;
  * bf16 on the CPU (and fp32 without the extension): oneDNN with the weight reordered once
    (torch.ops.mkldnn; 1.2-3.2x faster than MKL's F.linear on this project's AMD EPYC);
  * everywhere else: F.linear.
All are fp32-accumulating GEMMs; they differ in summation order only (~1e-4 on a logit).

The packed weight replaces the plain one (no second copy): a panel tensor is 1-D (its header
carries N and K), a oneDNN one an opaque mkldnn tensor of the same shape.
FREETOKEN_LINEAR=onednn skips the panels, =torch keeps F.linear (A/B switches, a way out).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import ops

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _mode() -> str:
    mode = os.environ.get("FREETOKEN_LINEAR", "auto").strip().lower() or "auto"
    if mode not in ("auto", "onednn", "torch"):
        raise ValueError(f"FREETOKEN_LINEAR must be auto, onednn or torch, got {mode!r}")
    return mode


def panels_available(weight: torch.Tensor) -> bool:
    """True when `weight` would be packed into panels here."""
    return _mode() == "auto" and ops.panel_linear_available(weight)


def packing_available(weight: torch.Tensor) -> bool:
    """True when `weight` can be served by some packed form here (panels or oneDNN)."""
    return panels_available(weight) or (
        _mode() != "torch"
        and weight.device.type == "cpu"
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> its packed form (see the module docstring); call only where
    packing_available(weight)."""
    weight = weight.detach().contiguous()
    if panels_available(weight):
        return ops.pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_form(weight: torch.Tensor) -> str:
    """"panels", "onednn" or "plain"."""
    if weight.is_mkldnn:
        return "onednn"
    return "panels" if weight.dim() == 1 else "plain"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., in] -> [..., out], by whichever form `weight` is in."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    if weight.dim() == 1:
        return ops.panel_linear(x.contiguous(), weight, bias)
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
        """Replace the plain weight by its packed form; False where none is available."""
        if packed_form(self.weight) != "plain":
            return True
        if not packing_available(self.weight):
            return False
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True
