"""The int8 compute mode's weights and products (csrc/linear/int8_linear.cpp): a GGUF weight's
integer codes repacked 16 outputs at a time, x quantized to int8 per block of 32 at each call,
integer dot products (AVX512-VNNI where the CPU has it, else AVX2, else a portable loop: the
same bits on all three), fp32 scales per group in one fixed order.

    int8_matrix(base, row_offsets, types, ends, in_features) -> the int8 matrix (panel_linear)
    int8_matrix_available(type) -> bool;  is_int8_matrix(weight) -> bool
    int8_matrix_unpack(weight) -> (u, a, b, c): each weight is a * (u - c) + b
    int8_quantize_rows(x) -> (q int8 [M, K], d fp32 [M, K / 32])
    int8_vnni_available() -> bool;  int8_peak_gops(iters, threads) -> the int8 bound (benchmarks)

No torch twin: the mode needs the extension (the exact mode is the default everywhere). Not the
choice of mode (freetoken/model/linear.py) nor the exact kernels (gguf.py, linear.py).
"""

from __future__ import annotations

import functools

import torch

from freetoken.ops.backend import _C, backend_for


@functools.cache
def _types() -> frozenset[str]:
    return frozenset(_C.int8_matrix_types()) if _C is not None else frozenset()


def int8_matrix_available(type: str) -> bool:  # noqa: A002
    """True when the extension computes GGUF type `type` in the int8 mode here."""
    return type in _types() and backend_for("cpu") == "ext-cpu"


def int8_matrix(base: torch.Tensor, row_offsets: torch.Tensor, types: list[str],
                ends: list[int], in_features: int) -> torch.Tensor:
    """A weight W [N, in_features] given as gguf_matrix takes it (row n's blocks at byte
    row_offsets[n] of `base`, rows [ends[s - 1], ends[s]) of GGUF type types[s]) -> its int8
    matrix: a 1-D uint8 tensor that owns the repacked codes and scales (`base` is only read
    here), which panel_linear computes with. Raises ValueError on a type without an int8 kernel,
    a bad size or offset."""
    from freetoken.ops.backend import require_ext

    require_ext("int8_matrix")
    return _C.int8_matrix(base, row_offsets.to(torch.int64).contiguous(), list(types),
                          [int(e) for e in ends], int(in_features))


def is_int8_matrix(weight: torch.Tensor) -> bool:
    """True for a weight from int8_matrix (False without the extension: there are none)."""
    return _C is not None and _C.is_int8_matrix(weight)


def int8_matrix_unpack(weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 matrix -> (u uint8 [N, K], a fp32 [N, K / 16], b fp32 [N, K / 16], c int32 [N]):
    weight [n, k] = a[n, k // 16] * (u[n, k] - c[n]) + b[n, k // 16] (for tests)."""
    return _C.int8_matrix_unpack(weight)


def int8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 (K a multiple of 32) -> (q int8 [M, K], d fp32 [M, K / 32]): per block of
    32, d = amax / 127 and q = rint(x * (127 / amax)), as the int8 linear quantizes its input."""
    return _C.int8_quantize_rows(x.contiguous())


def int8_vnni_available() -> bool:
    """True when this CPU runs the VNNI kernel (else the portable one, with the same bits)."""
    return _C is not None and _C.int8_vnni_available()


def int8_peak_gops(iters: int, threads: int) -> float:
    """The machine's int8 bound for benchmarks: GOP/s (2 a product) of `threads` threads each
    running `iters` rounds of 12 independent vpdpbusd on registers. Needs AVX512-VNNI."""
    from freetoken.ops.backend import require_ext

    require_ext("int8_peak_gops")
    return _C.int8_peak_gops(int(iters), int(threads))
