"""The model checker's run-wide resources: one SeaweedFS server and bucket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .machine import DaemonMachine
from .world import Resources


@pytest.fixture(scope="session")
def resources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Resources]:
    """One SeaweedFS and bucket for every sequence (each its own prefix and root)."""
    res = Resources(tmp_path_factory.mktemp("model"))
    DaemonMachine.resources = res
    try:
        yield res
    finally:
        DaemonMachine.resources = None
        res.close()
