"""tests/server: the app over HTTP: in process (freetoken.testing.live.LiveServer) or a `python -m
freetoken` subprocess (freetoken.testing.process.ServerProcess), with the real SmolLM2.

This folder's tests carry the `server` marker (`pytest -m server`)."""

from __future__ import annotations

import pytest
from folders import mark_folder

from freetoken.testing.live import LiveServer


def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "server")


@pytest.fixture(scope="module")
def loaded(smollm2_fp32):
    """SmolLM2 on one torch thread (the in-process servers of test_pressure / test_reliability)."""
    import torch

    torch.set_num_threads(1)
    return smollm2_fp32


@pytest.fixture
def live(loaded):
    """make(engine=None, **app_kw) -> a LiveServer on `loaded`, closed after the test."""
    made: list[LiveServer] = []

    def make(engine: dict | None = None, **app_kw) -> LiveServer:
        made.append(LiveServer(loaded, engine, **app_kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
