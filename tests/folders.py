"""The marker each test folder gives its tests: tests/<folder>/conftest.py calls mark_folder from
its pytest_collection_modifyitems hook (which pytest calls with every collected item)."""

from __future__ import annotations

from pathlib import Path


def mark_folder(items, conftest: str, marker: str) -> list:
    """Add `marker` to the items under the folder of `conftest`; returns those items."""
    here = Path(conftest).parent
    mine = [item for item in items if here in item.path.parents]
    for item in mine:
        item.add_marker(marker)
    return mine
