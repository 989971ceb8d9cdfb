"""freetoken._C's CPU kernel variants (AVX-512, AVX2, baseline x86-64), for the tests that hold
every variant to the same reference: which ones this machine runs (conftest.py's `isa` fixture
forces each in turn)."""

from __future__ import annotations

import freetoken.ops as ops

VARIANTS = ("avx512", "avx2", "base")


def available_isas() -> list[str]:
    """The variants set_cpu_isa accepts here (cpuid-checked); [] without the extension."""
    if ops._C is None:
        return []
    out = []
    for name in VARIANTS:
        try:
            ops._C.set_cpu_isa(name)
            out.append(name)
        except RuntimeError:
            pass
    ops._C.set_cpu_isa("auto")
    return out
