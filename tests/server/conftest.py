"""tests/server: the app over HTTP: in process (freetoken.testing.live.LiveServer) or a `python -m
freetoken` subprocess (freetoken.testing.process.ServerProcess), with the real SmolLM2.

This folder's tests carry the `server` marker (`pytest -m server`)."""

from __future__ import annotations

from folders import mark_folder


def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "server")
