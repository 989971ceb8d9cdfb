"""The panel linear: y = x @ W^T (+ bias) over a weight packed once into panels of 16 rows, fp32 or
bf16 (csrc/linear/linear_cpu.cpp), or from a GGUF file's Q4_1 / Q8_0 blocks dequantized exactly
in registers (csrc/linear/quant_linear_cpu.cpp), for the small-M decode steps; or over a GGUF
weight left in its file's blocks (the descriptor from ops.gguf_matrix, csrc/linear/gguf_linear.cpp).

    pack_panels(weight) -> packed;  pack_gguf_panels(rows, type, in_features) -> packed
    panel_linear(x, packed, bias=None) -> x @ W^T (+ bias)
    panel_linear_available(x), panel_shape(packed) -> (N, K), gguf_panel_type(packed)

CPU extension only, and no torch twin: the packed format has no meaning outside the kernel, so
the caller keeps its own path where panel_linear_available() is False (freetoken/model/linear.py,
which also chooses between the forms; tests/unit/test_panel_linear.py holds the kernel to F.linear).
"""

from __future__ import annotations

import torch

from freetoken.ops.backend import _C, backend_for, require_ext

_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def panel_linear_available(x: torch.Tensor) -> bool:
    """True when panel_linear serves x: x on a device the extension serves on the CPU
    ("ext-cpu"), fp32 or bf16. There is no torch twin for the packed format; callers keep their
    own path (freetoken/model/linear.py) where this is False."""
    return x.dtype in _PANEL_DTYPES and backend_for(x.device) == "ext-cpu"


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 or bf16 CPU -> packed: a 1-D tensor of its dtype, a 64-byte header
    (int32 words: magic, version, N, K, 16, number of panels, dtype) then ceil(N / 16) panels
    [K, 16], panel p holding W[16p:16p+16, :].T with rows >= N zero. Opaque to everything but
    panel_linear / panel_shape; it survives clone(), torch.save and nn.Parameter (the header
    travels with the data)."""
    require_ext("pack_panels")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or weight.dtype not in _PANEL_DTYPES or weight.device.type != "cpu":
        raise ValueError("pack_panels: weight must be a 2-D fp32 or bf16 CPU tensor [N, K]")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"pack_panels: weight must not be empty, got {tuple(weight.shape)}")
    return _C.panel_pack(weight.detach())


GGUF_PANEL_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K")  # in the order of their header codes 2-5
# (weights, bytes) of a block in the GGUF file
_GGUF_BLOCKS = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def pack_gguf_panels(rows: torch.Tensor, type: str, in_features: int,  # noqa: A002
                     release_rows: bool = False) -> torch.Tensor:
    """A weight W [N, K] as its GGUF file stores it (rows [N, K / block values * block bytes]
    uint8 of `type`, one of GGUF_PANEL_TYPES) -> packed panels (1-D uint8, the pack_panels
    header with dtype 2-5) for panel_linear with fp32 x. Each weight is dequantized in
    registers to exactly the fp32 value gguf.quants.dequantize gives
    (csrc/linear/quant_linear_cpu.cpp).
    `release_rows`: `rows` is a contiguous view of a file's read-only memory map, whose pages are
    unmapped from the process as they are consumed (never pass anything else: anonymous memory
    would be zeroed)."""
    require_ext("pack_gguf_panels")
    if type not in GGUF_PANEL_TYPES:
        raise ValueError(f"pack_gguf_panels: type must be one of {GGUF_PANEL_TYPES}, got {type!r}")
    values, block_bytes = _GGUF_BLOCKS[type]
    if not isinstance(in_features, int) or in_features < values or in_features % values:
        raise ValueError(f"pack_gguf_panels: in_features must be a positive multiple of "
                         f"{values} for {type}, got {in_features!r}")
    row_bytes = in_features // values * block_bytes
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2 \
            or rows.device.type != "cpu" or rows.shape[0] == 0 or rows.shape[1] != row_bytes:
        raise ValueError(f"pack_gguf_panels: rows must be a uint8 CPU tensor [N >= 1, "
                         f"{row_bytes}] ({type} blocks of {in_features} weights)")
    return _C.gguf_pack(rows, type, in_features, release_rows)


def gguf_panel_type(packed: torch.Tensor) -> str | None:
    """"Q4_1" / "Q8_0" / "Q4_K" / "Q6_K" for a tensor from pack_gguf_panels, None for one from
    pack_panels (or a gguf_matrix descriptor)."""
    from freetoken.ops.gguf import is_gguf_matrix

    if packed.dtype != torch.uint8 or is_gguf_matrix(packed):
        return None
    panel_shape(packed)  # checks the header
    return GGUF_PANEL_TYPES[int(packed[24]) - 2]  # header word 6, little-endian


def panel_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a tensor from pack_panels, pack_gguf_panels or gguf_matrix (checks its
    header)."""
    require_ext("panel_shape")
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
    require_ext("panel_linear")
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
