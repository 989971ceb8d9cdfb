"""GGUF blocks -> fp32 weights, each exactly the value the gguf package's `dequantize` gives.

    dequantize_gguf(rows, type, in_features) -> [N, in_features] fp32
    gguf_dequantize_available(type) -> bool

The kernel (csrc/linear/gguf_dequant.cpp) covers F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS, per ISA; the twin is `gguf.quants.dequantize`
itself (numpy), which also covers the types the kernel does not. tests/ hold the two equal bit
for bit. Not here: reading the file (freetoken/loader/gguf.py).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from freetoken.ops.backend import _C, backend_for


@functools.cache
def _kernel_types() -> frozenset[str]:
    return frozenset(_C.gguf_dequantize_types()) if _C is not None else frozenset()


def gguf_dequantize_available(type: str) -> bool:  # noqa: A002
    """True when the extension dequantizes GGUF type `type` here."""
    return type in _kernel_types() and backend_for("cpu") == "ext-cpu"


def dequantize_gguf(rows: np.ndarray | torch.Tensor, type: str,  # noqa: A002
                    in_features: int) -> torch.Tensor:
    """rows [N, in_features / block * block bytes] uint8 of GGUF type `type` (for F32 / F16 /
    BF16: the raw bytes) -> [N, in_features] fp32, exactly gguf.quants.dequantize's values."""
    if not gguf_dequantize_available(type):
        import gguf

        out = gguf.quants.dequantize(_byte_rows(rows), gguf.GGMLQuantizationType[type])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
    # NOTE: a uint8 tensor goes straight to the kernel: the embedding decodes a row a step this
    # way, and the numpy round trip (and its warnings context) cost one served stream ~4 % of
    # its tokens/s, waiting for the GIL at each of its calls (docs/benchmarks.md, stop 47)
    if not (isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 and rows.dim() == 2):
        with warnings.catch_warnings():
            # NOTE: a GGUF's memory map is read-only; the kernel only reads it, so torch's
            # warning about writing through a read-only array does not apply.
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(_byte_rows(rows))
    return _C.gguf_dequantize(rows.contiguous(), type, in_features)


def _byte_rows(rows: np.ndarray | torch.Tensor) -> np.ndarray:
    """rows as a contiguous [N, row bytes] uint8 array."""
    array = np.ascontiguousarray(rows)
    return array.view(np.uint8).reshape(array.shape[0], -1)


@functools.cache
def _matrix_types() -> frozenset[str]:
    return frozenset(_C.gguf_matrix_types()) if _C is not None else frozenset()


def gguf_matrix_available(type: str) -> bool:  # noqa: A002
    """True when the extension computes with GGUF type `type` in place here (gguf_matrix)."""
    return type in _matrix_types() and backend_for("cpu") == "ext-cpu"


def gguf_matrix(base: torch.Tensor, row_offsets: torch.Tensor, types: list[str],
                ends: list[int], in_features: int) -> torch.Tensor:
    """A weight W [N, in_features] left in its GGUF blocks: row n's blocks at byte
    row_offsets[n] of `base` (a 1-D uint8 tensor, the file's read-only mapping), rows
    [ends[s - 1], ends[s]) of GGUF type types[s] (a fused q|k|v may mix types) -> the descriptor
    that panel_linear takes (csrc/linear/gguf_linear.cpp: decoded to exactly the fp32 values of
    dequantize_gguf, fp32 FMAs in one fixed order). The descriptor holds addresses into `base`:
    keep `base` alive as long as it is used. Raises ValueError on a bad type, size or offset."""
    from freetoken.ops.backend import require_ext

    require_ext("gguf_matrix")
    return _C.gguf_matrix(base, row_offsets.to(torch.int64).contiguous(), list(types),
                          [int(e) for e in ends], int(in_features))


def gguf_row_bytes(type: str, in_features: int) -> int:  # noqa: A002
    """Bytes of one row of `in_features` weights of GGUF type `type`."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type]]
    return in_features // block * nbytes


def is_gguf_matrix(weight: torch.Tensor) -> bool:
    """True for a descriptor from gguf_matrix (False without the extension: there are none)."""
    return _C is not None and _C.is_gguf_matrix(weight)
