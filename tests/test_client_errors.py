"""What a trainer sees when things go wrong: one public name per error, and a client
that never reached a daemon says so at once."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import ckptd.client
from ckptd.client import CkptdError, CkptdUnavailable, Client
from ckptd.core import errors
from ckptd.core.errors import from_status

from .conftest import Daemon

DOCUMENTED = [
    "CkptdError",
    "CkptdUnavailable",
    "SaveFailed",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CapacityExhausted",
    "InvalidArgument",
    "FailedPrecondition",
    "Conflict",
    "TreeMismatch",
    "PermissionDenied",
]
"""The error names the README and the guides tell trainers to catch."""


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_error_names_are_the_classes_ckptd_client_exports(name: str) -> None:
    cls = getattr(ckptd.client, name)
    assert issubclass(cls, CkptdError) and name in ckptd.client.__all__
    # What a traceback prints is the name the user imports and catches.
    assert f"{cls.__module__}.{cls.__qualname__}" == f"ckptd.client.{name}"


def test_every_error_class_has_its_one_public_name() -> None:
    found = vars(errors).values()
    classes = {v for v in found if isinstance(v, type) and issubclass(v, CkptdError)}
    for cls in classes:
        assert getattr(ckptd.client, cls.__name__) is cls, cls
    for code in grpc.StatusCode:
        raised = from_status(code, "m")
        assert getattr(ckptd.client, type(raised).__name__) is type(raised)


def _no_daemon(tmp_path: Path, **kw: Any) -> Client:
    # An hour of reconnect patience: a client that never reached a daemon must not use it.
    return Client("j", socket=tmp_path / "nothing.sock", reconnect_timeout=3600.0, **kw)


def test_a_client_that_never_reached_a_daemon_fails_fast_saying_how_to_start_one(
    tmp_path: Path,
) -> None:
    sock = str(tmp_path / "nothing.sock")
    with _no_daemon(tmp_path, connect_timeout=0.5) as client:
        assert not client.connection.reached
        assert client._handoff.patience() == 0.5  # the never-reached budget, not the hour
        with pytest.raises(CkptdUnavailable) as saved:
            client.save(1, {"x": np.arange(4)})
        with pytest.raises(CkptdUnavailable) as restored:
            client.restore()
    for info in (saved, restored):
        text = str(info.value)
        assert "never reached" in text and f"--socket {sock}" in text
        assert "ckptd serve --root" in text and "CKPTD_SOCKET" in text
        assert type(info.value) is ckptd.client.CkptdUnavailable
        line = traceback.format_exception_only(info.value)[0]
        assert line.startswith("ckptd.client.CkptdUnavailable: ")


def test_the_default_never_reached_budget_is_short(tmp_path: Path) -> None:
    with _no_daemon(tmp_path) as client:
        assert client._handoff.patience() <= 5.0
        with pytest.raises(CkptdUnavailable, match="ckptd serve --root"):
            client.save(1, {"x": np.arange(4)})


def test_a_client_that_reached_its_daemon_waits_out_a_restart(make_daemon: Any) -> None:
    daemon: Daemon = make_daemon()
    client = daemon.client("patient", connect_timeout=0.0, reconnect_timeout=300.0)
    client.save(1, {"x": np.arange(4)}).wait("local")
    assert client.connection.reached and client._handoff.patience() == 300.0
    refused = threading.Event()
    acquire = client.connection.acquire_lease

    def spy(*args: Any, **kw: Any) -> Any:
        try:
            return acquire(*args, **kw)
        except CkptdUnavailable:
            refused.set()
            raise

    client.connection.acquire_lease = spy  # type: ignore[method-assign]
    daemon.kill()

    def restart_once_refused() -> None:
        refused.wait()
        daemon.restart()

    restarter = threading.Thread(target=restart_once_refused)
    restarter.start()
    try:
        # With connect_timeout=0 this would fail at the first refusal, were it used.
        client.save(2, {"x": np.arange(4)}).wait("local")
    finally:
        refused.set()
        restarter.join()
    assert client.latest_step() == 2
