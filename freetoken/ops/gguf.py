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
    array = np.ascontiguousarray(rows)
    array = array.view(np.uint8).reshape(array.shape[0], -1)  # [N, row bytes]
    if gguf_dequantize_available(type):
        return _C.gguf_dequantize(torch.from_numpy(array), type, in_features)
    import gguf

    out = gguf.quants.dequantize(array, gguf.GGMLQuantizationType[type])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
