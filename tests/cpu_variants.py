"""freetoken._C's CPU kernel variants (AVX-512, AVX2, baseline x86-64), for the tests that hold
every variant to the same reference: which ones this machine runs (conftest.py's `isa` fixture
forces each in turn)."""

from __future__ import annotations

import freetoken.ops as ops

VARIANTS = ("avx512", "avx2", "base")


def available_isas() -> list[str]:
    """The variants ops.configure(cpu_isa=...) accepts here (cpuid-checked); [] without the
    extension."""
    return list(ops.available_cpu_isas())
