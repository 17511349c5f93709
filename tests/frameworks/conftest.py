"""Every test under tests/frameworks is a ``frameworks`` test: `make test-frameworks`
runs them (and .ci/run), `make test` does not (real training loops take minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.frameworks)
