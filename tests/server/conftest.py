"""tests/server: the app over HTTP: in process (freetoken.testing.live.LiveServer) or a `python -m
freetoken` subprocess (freetoken.testing.process.ServerProcess), with the real SmolLM2.

This folder's tests carry the `server` marker (`pytest -m server`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.server)
