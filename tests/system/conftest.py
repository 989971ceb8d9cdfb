"""tests/system: the whole system under stress or over its life: load and soak, the router
with replicas, fuzzing, start-up and shutdown. The slowest folder.

This folder's tests carry the `system` marker (`pytest -m system`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.system)
