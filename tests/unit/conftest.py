"""tests/unit: no model file and no server: the pure-Python and kernel tests.
`bash scripts/test --quick` runs only these (well under a minute); a test here that asks for
the model is a collection error.

This folder's tests carry the `unit` marker (`pytest -m unit`)."""

from __future__ import annotations

import pytest
from folders import mark_folder

# what needs the model file (tests/conftest.py)
MODEL_FIXTURES = {"smollm2_path", "smollm2_fp32", "transformers_smollm2", "tiny_checkpoint"}


def pytest_collection_modifyitems(items):
    for item in mark_folder(items, __file__, "unit"):
        needs = MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        if needs:
            raise pytest.UsageError(f"{item.nodeid} is a unit test but uses {sorted(needs)}:"
                                    " it belongs in tests/model/")
