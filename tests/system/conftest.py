"""tests/system: the whole system under stress or over its life: load and soak, the router
with replicas, fuzzing, start-up and shutdown. The slowest folder.

This folder's tests carry the `system` marker (`pytest -m system`)."""

from __future__ import annotations

from folders import mark_folder


def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "system")
