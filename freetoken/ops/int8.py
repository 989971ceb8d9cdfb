"""The int8 compute mode's weights and products (csrc/linear/int8_linear.cpp): a GGUF weight's
integer codes repacked 16 outputs at a time, x quantized to int8 at each call (per block of 32,
or of 256 when the weight holds a K-quant), integer dot products (AVX512-VNNI where the CPU has
it, else AVX2, else a portable loop: the same bits on all three), fp32 scales in one fixed order:
a group at a time, or for a K-quant a superblock at a time after its groups' integer sums.

    int8_matrix(base, row_offsets, types, ends, in_features) -> the int8 matrix (panel_linear)
    int8_matrix_available(type) -> bool;  is_int8_matrix(weight) -> bool
    int8_matrix_unpack(weight) -> (u, a, b, c): each weight is a * (u - c) + b
    int8_matrix_superblocks(weight) -> (d, dmin, sc, mn): a K-quant's own numbers
    int8_quantize_rows(x, block=32) -> (q int8 [M, K], d fp32 [M, K / 32])
    int8_silu_linear(gate_up, weight, bias=None) -> panel_linear(silu_mul(gate_up), weight, bias)
    int8_vnni_available() -> bool;  int8_peak_gops(iters, threads) -> the int8 bound (benchmarks)
    int8_bound_loop() -> the instructions that bound times

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


def int8_matrix_superblocks(weight: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 matrix -> a K-quant's own numbers, which its superblock arithmetic uses: d and
    dmin fp32 [N, K / 256] (Q6_K: dmin 0), sc and mn int32 [N, K / 16] (each group's value on
    its 16s), with a = d * sc and b = -(dmin * mn); zeros outside K-quant panels (for tests)."""
    return _C.int8_matrix_superblocks(weight)


def int8_quantize_rows(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 (K a multiple of `block`, 32 or 256) -> (q int8 [M, K], d fp32 [M, K / 32]):
    per block, d = amax / 127 and q = rint(x * (127 / amax)), as the int8 linear quantizes its
    input (a block of 256's d repeated for each of its 32s)."""
    return _C.int8_quantize_rows(x.contiguous(), int(block))


def int8_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [M, 2K] fp32, an int8 matrix [N, K] -> (silu(gate) * up) W^T (+ bias) [M, N]: the
    bits of panel_linear(silu_mul(gate_up, K), weight, bias), the activation made a row at a time
    into the quantization's input instead of stored whole (the int8 decoder layer's down
    projection)."""
    return _C.int8_silu_linear(gate_up, weight, bias)


def int8_vnni_available() -> bool:
    """True when this CPU runs the VNNI kernel (else the portable one, with the same bits)."""
    return _C is not None and _C.int8_vnni_available()


def int8_peak_gops(iters: int, threads: int) -> float:
    """The machine's int8 bound for benchmarks: GOP/s (2 a product) of `threads` threads each
    running `iters` rounds of register-only products in the instructions of the int8 loop in use
    (int8_bound_loop names them). Needs AVX512-VNNI or AVX2."""
    from freetoken.ops.backend import require_ext

    require_ext("int8_peak_gops")
    return _C.int8_peak_gops(int(iters), int(threads))


def int8_amx_available() -> bool:
    """True when this CPU has AMX-INT8 and the process may use its tiles: the int8 linear then
    computes steps of 32 rows and more with tile products, every int8 format, with the same bits
    as the VNNI loop."""
    return _C is not None and _C.int8_amx_available()


def set_int8_amx(allowed: bool) -> bool:
    """Allows (the default) or forbids the int8 linear's AMX loop, for tests and A/B runs;
    returns the previous setting."""
    from freetoken.ops.backend import require_ext

    require_ext("set_int8_amx")
    return _C.set_int8_amx(bool(allowed))


def int8_avx_vnni_available() -> bool:
    """True when the int8 linear runs its 8-lane (AVX2) loop on a CPU with AVX-VNNI: its steps
    are then one vpdpbusd each (the same bits as the vpmaddubsw steps)."""
    return _C is not None and _C.int8_avx_vnni_available()


def set_int8_avx_vnni(allowed: bool) -> bool:
    """Allows (the default) or forbids AVX-VNNI in the int8 linear's AVX2 loop, for tests and A/B
    runs; returns the previous setting."""
    from freetoken.ops.backend import require_ext

    require_ext("set_int8_avx_vnni")
    return _C.set_int8_avx_vnni(bool(allowed))


def int8_bound_loop() -> str | None:
    """The instructions int8_peak_gops times, those of the fastest int8 loop in use on this CPU
    at the ISA in use: 'tdpbssd (AMX-INT8)', 'vpdpbusd (AVX512-VNNI)', 'vpdpbusd (AVX-VNNI)',
    'vpmaddubsw+vpaddw (AVX2)', or None (portable, or no extension)."""
    return (_C.int8_bound_loop() or None) if _C is not None else None
