"""ckptd's ``ocp.training.Checkpointer`` (Orbax's v1 API, what MaxText 0.2.5 builds)
against a real daemon, with Orbax's own policy, context and metadata classes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

from ckptd.client import orbax as ckptd_orbax  # noqa: E402
from ckptd.core.errors import InvalidArgument  # noqa: E402

from ..conftest import Daemon  # noqa: E402
from .test_orbax_manager import abstract, assert_equal, state  # noqa: E402

v1 = ocp.experimental.v1
training = v1.training


def checkpointer(daemon: Daemon, job: str, **kw: Any) -> Any:
    return ckptd_orbax.Checkpointer(f"/unused/{job}/checkpoints", socket=daemon.socket, **kw)


def test_maxtexts_calls_round_trip(daemon: Daemon) -> None:
    """What MaxText 0.2.5's checkpointing module does, call for call."""
    ctx = v1.Context()
    ctx.pytree.loading.partial_load = True
    ckpt = checkpointer(
        daemon,
        "v1",
        context=ctx,
        save_decision_policy=training.save_decision_policies.FixedIntervalPolicy(interval=2),
        preservation_policy=training.preservation_policies.LatestN(2),
    )
    assert isinstance(ckpt, training.Checkpointer)  # MaxText asserts this before loading
    ckpt.use_async = True  # MaxText sets it
    assert ckpt.latest is None and ckpt.checkpoints == []
    assert ckpt.save_checkpointables_async(1, {"items": state(1)}) is None  # the policy: no
    for step in (2, 4, 6):
        resp = ckpt.save_checkpointables_async(
            step, {"items": state(step)}, custom_metadata={"scan_layers": True}
        )
        assert resp is not None
    assert resp.result() is True
    with pytest.raises(FileExistsError):  # Orbax's StepAlreadyExistsError
        ckpt.save_checkpointables(6, {"items": state(6)}, force=True)
    assert ckpt.save_checkpointables(7, {"items": state(7)}, force=True) is True
    ckpt.wait()
    # LatestN(2) is the job's retention: what Orbax lists is what exists.
    deadline = time.monotonic() + 60
    while [c.step for c in ckpt.checkpoints] != [6, 7]:
        assert time.monotonic() < deadline, [c.step for c in ckpt.checkpoints]
        time.sleep(0.05)
    assert ckpt.latest.step == 7
    assert isinstance(ckpt.directory, Path | type(ckpt.directory))
    meta = ckpt.metadata(7)
    assert meta.step == 7 and meta.custom_metadata == {} and "items" in meta.metadata
    assert ckpt.metadata(6).custom_metadata == {"scan_layers": True}
    # Partial load: an entry the step lacks comes back as given (MaxText fills it).
    target = {"items": {**abstract(state(7)), "extra": jax.ShapeDtypeStruct((2,), np.float32)}}
    got = ckpt.load_checkpointables(None, target)
    extra = got["items"].pop("extra")
    assert isinstance(extra, jax.ShapeDtypeStruct)
    assert_equal(got["items"], state(7))
    with pytest.raises(FileNotFoundError):  # Orbax's StepNotFoundError
        ckpt.load_checkpointables(2, target)
    ckpt.close()
    # A new one (a restarted trainer) finds the steps; load and save as Orbax's.
    keep = training.preservation_policies.LatestN(2)  # the same settings as before
    again = checkpointer(daemon, "v1", context=ctx, preservation_policy=keep)
    assert [c.step for c in again.checkpoints] == [6, 7]
    assert_equal(again.load(None, abstract(state(7)), checkpointable_name="items"), state(7))
    assert again.save(8, state(8), force=True)
    assert_equal(again.load(8, abstract(state(8))), state(8))
    again.close()


def test_what_it_refuses(daemon: Daemon) -> None:
    class Iterator:  # a checkpointable that saves itself, as MaxText's grain iterator
        def save(self, directory: Any) -> None: ...

        def load(self, directory: Any) -> None: ...

    ckpt = checkpointer(daemon, "refuse")
    with pytest.raises(InvalidArgument, match="grain iterator"):
        ckpt.save_checkpointables(1, {"items": state(1), "iter": Iterator()}, force=True)
    with pytest.raises(InvalidArgument, match="overwrite"):
        ckpt.save_checkpointables(1, {"items": state(1)}, force=True, overwrite=True)
    ckpt.close()
