"""The model's linear layers, by the form their weight was packed into at load:

  * fp32 on the CPU with freetoken._C: panels (ops.pack_panels / ops.panel_linear,
    csrc/linear_cpu.cpp), a layout that streams each weight once per call. Decode steps are
    weight-bandwidth bound and oneDNN read cold weights at half the rate (a decode step's
    linears at 8 rows: 43.7 -> 22.8 ms); at 224 rows (a batched prefill) the two are level;
  * bf16 on the CPU: oneDNN with the weight reordered once (torch.ops.mkldnn; 1.2-3.2x faster
    than MKL's F.linear on this project's AMD EPYC), plus panels for steps of few rows (below);
    fp32 without the extension: oneDNN;
  * everywhere else: F.linear.
All are fp32-accumulating GEMMs; they differ in summation order only (~1e-4 on a logit).

The packed weight replaces the plain one: a panel tensor is 1-D (its header carries N, K and the
dtype), a oneDNN one an opaque mkldnn tensor of the same shape; only bf16 keeps a second copy.
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


# NOTE: bf16 keeps a second form for few rows. oneDNN's AVX512-BF16 dot products run at twice the
# fp32 FLOP rate, while the panels widen bf16 to fp32 FMAs: on the classify step (8 x 28 rows)
# panels took 364-381 ms against oneDNN's 193-221. With few rows the panels win (half the bytes,
# read at stream rate; decode 1 x 1: 17-20 vs 32-35 ms). So a bf16 weight is packed both ways,
# and steps of at most FEW_ROWS rows take the panels: two bf16 copies are one fp32 copy's bytes.
FEW_ROWS = 8


def panels_available(weight: torch.Tensor) -> bool:
    """True when `weight`'s dtype and device have the panel kernel here (FREETOKEN_LINEAR=auto)."""
    return _mode() == "auto" and ops.panel_linear_available(weight)


def _onednn_available(weight: torch.Tensor) -> bool:
    return (
        _mode() != "torch"
        and weight.device.type == "cpu"
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packing_available(weight: torch.Tensor) -> bool:
    """True when `weight` can be served by some packed form here (panels or oneDNN)."""
    return panels_available(weight) or _onednn_available(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> its packed form for every row count (see the module docstring):
    panels for fp32, oneDNN for bf16 (panels where oneDNN is missing). Call only where
    packing_available(weight)."""
    weight = weight.detach().contiguous()
    if panels_available(weight) and (weight.dtype == torch.float32
                                     or not _onednn_available(weight)):
        return ops.pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def pack_few_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """The second form, for steps of at most FEW_ROWS rows: panels of a bf16 weight whose main
    form is oneDNN; None where the main form serves every row count."""
    if weight.dtype != torch.float32 and panels_available(weight) and _onednn_available(weight):
        return ops.pack_panels(weight.detach().contiguous())
    return None


def packed_form(weight: torch.Tensor) -> str:
    """"panels", "onednn" or "plain"."""
    if weight.is_mkldnn:
        return "onednn"
    return "panels" if weight.dim() == 1 else "plain"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           few_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] -> [..., out], by whichever form `weight` is in; `few_rows` (from
    pack_few_rows) takes over for at most FEW_ROWS rows."""
    if few_rows is not None and x.numel() <= FEW_ROWS * x.shape[-1]:
        return ops.panel_linear(x.contiguous(), few_rows, bias)
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
        self.few_rows: torch.Tensor | None = None  # bf16's panel copy (pack_few_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.few_rows)

    def pack(self) -> bool:
        """Replace the plain weight by its packed form(s); False where none is available."""
        if packed_form(self.weight) != "plain":
            return True
        if not packing_available(self.weight):
            return False
        self.few_rows = pack_few_rows(self.weight)
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True
