"""Health tags: NaN/Inf counted as a step is written, restore(healthy=True), and the
last-known-good step kept by every tier (core/health.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from ckptd.client import CheckpointNotFound
from ckptd.core.errors import FailedPrecondition
from ckptd.core.health import NONFINITE_METRIC, NonFiniteCount, count_nonfinite, plan
from ckptd.core.manifest import Manifest, ManifestInvalid, RankRecord
from ckptd.daemon.retention.plan import StepView, plan_job
from ckptd.daemon.retention.policies import KeepLatest
from ckptd.proto import ckptd_pb2 as pb

from .conftest import CKPTD, META, RemoteTarget
from .test_remote_tier import remote_daemon
from .test_retention_tier import settled

# -- counting -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,name",
    [
        (np.float32, "<f4"),
        (np.float64, "<f8"),
        (np.float16, "<f2"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (ml_dtypes.float8_e5m2, "float8_e5m2"),
        (np.complex64, "<c8"),
    ],
)
def test_each_float_dtype_counts_nan_and_both_infinities(dtype: Any, name: str) -> None:
    x = np.linspace(-3, 3, 4099).astype(dtype)
    assert count_nonfinite(x, name) == 0
    x[[0, 17, 4098]] = [np.nan, np.inf, -np.inf]
    assert count_nonfinite(x, name) == 3
    # The largest finite value is not Inf (its exponent is not all ones).
    assert count_nonfinite(np.full(8, ml_dtypes.finfo(dtype).max, dtype), name) == 0


def test_integer_and_bool_shards_are_not_counted() -> None:
    assert count_nonfinite(np.full(4, -1, np.int32), "<i4") is None
    assert count_nonfinite(np.ones(4, bool), "|b1") is None


def test_counting_fed_in_chunks_equals_counting_each_shard_whole() -> None:
    """The trail feeds whatever the write reached: cuts inside elements, inside shards
    and between them must not change a count."""
    rng = np.random.default_rng(0)
    shards = [
        ("a", "<f4", rng.standard_normal(1000).astype(np.float32)),
        ("i", "<i8", np.arange(64)),
        ("b", "bfloat16", rng.standard_normal(3001).astype(ml_dtypes.bfloat16)),
        ("c", "<f8", rng.standard_normal(500)),
        ("d", "<f2", rng.standard_normal(777).astype(np.float16)),
    ]
    shards[0][2][[5, 999]] = np.nan
    shards[2][2][[0, 1, 3000]] = np.inf
    shards[4][2][400] = -np.inf
    data, ranges = bytearray(), []
    for _, _, arr in shards:
        ranges.append((len(data), arr.nbytes))
        data += arr.tobytes()
    flat = np.frombuffer(bytes(data), np.uint8)
    keys = [k for k, _, _ in shards]
    todo = plan([d for _, d, _ in shards], ranges)
    want = {"a": 2, "b": 3, "d": 1}
    for cuts in ([len(flat)], [1, 3, 4001, 4002, 9000, len(flat)], range(7, len(flat) + 7, 7)):
        count = NonFiniteCount(keys, todo)
        for upto in cuts:
            count.feed(flat, min(upto, len(flat)))
        count.feed(flat, 5)  # a repeat that reaches no further: a no-op
        assert count.result() == want
    half = NonFiniteCount(keys, todo)
    half.feed(flat, len(flat) // 2)
    with pytest.raises(ValueError, match="not every floating shard"):
        half.result()


# -- the manifest -------------------------------------------------------------------


def _manifest(nonfinite: Any) -> Manifest:
    return Manifest(
        job="j",
        step=1,
        node="n",
        world_size=1,
        created_unix=1.0,
        ranks=[RankRecord(0, "rank-00000.safetensors", 4096, 0, None)],
        nonfinite=nonfinite,
    )


def test_manifest_carries_the_counts_and_refuses_malformed_ones() -> None:
    m = _manifest({"0": {"w": 3}})
    assert Manifest.from_json(m.to_json()).nonfinite == {"0": {"w": 3}}
    assert Manifest.from_json(_manifest(None).to_json()).nonfinite is None
    for bad in ([1], {"0": [1]}, {"0": {"w": -1}}, {"0": {"w": "3"}}, {"0": {"w": True}}):
        with pytest.raises(ManifestInvalid, match="nonfinite"):
            Manifest.from_json(_manifest(bad).to_json())


# -- retention ----------------------------------------------------------------------


def _views(health: list[bool | None]) -> list[StepView]:
    return [StepView(step=i, time=float(i), local=True, healthy=h) for i, h in enumerate(health)]


def test_the_last_known_good_step_is_kept_while_newer_steps_are_not_healthy() -> None:
    keep1 = KeepLatest(1)
    p = plan_job(_views([True, True, False, False]), keep1, None, 10.0)
    assert p.evict_local == [0, 2]
    assert p.local_reasons[1] == ["last-known-good"]
    # Once a newer step is healthy again, the old one goes like any other.
    p = plan_job(_views([True, True, False, True]), keep1, None, 10.0)
    assert p.evict_local == [0, 1, 2]
    # Steps of unknown health (an older ckptd) do not hold anything back.
    p = plan_job(_views([True, None, None]), keep1, None, 10.0)
    assert p.evict_local == [0, 1]
    # The bucket keeps it too.
    views = [
        StepView(step=i, time=float(i), remote=True, healthy=h)
        for i, h in enumerate([True, False, False])
    ]
    p = plan_job(views, keep1, keep1, 10.0)
    assert p.evict_remote == [1]
    assert p.remote_reasons[0] == ["last-known-good"]


# -- end to end ---------------------------------------------------------------------


def _state(step: int, bad: int = 0) -> dict[str, Any]:
    w = np.full(10_000, float(step), np.float32)
    w[:bad] = np.nan
    b = np.full(300, step, ml_dtypes.bfloat16)
    if bad:
        b[-1] = np.inf
    return {"w": w, "b": b, "n": np.arange(100, dtype=np.int64) + step}


def test_a_diverged_run_restores_its_last_known_good_step_from_every_tier(
    make_daemon: Any, tmp_path: Path
) -> None:
    remote = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    args = ["--retention-local", "KeepLatest(1)", "--retention-remote", "KeepLatest(1)"]
    daemon = remote_daemon(make_daemon, remote, extra_args=args)
    client = daemon.client("div")
    client.save(1, _state(1), metrics={"loss": 0.5}).wait("durable", 60)
    client.save(2, _state(2, bad=7)).wait("durable", 60)
    client.save(3, _state(3, bad=2)).wait("durable", 60)
    settled(client, [1, 3], [1, 3])
    rows = {c.step: c for c in client.list()}
    assert rows[1].healthy is True and rows[1].metrics == {"loss": 0.5, NONFINITE_METRIC: 0}
    assert rows[3].healthy is False and rows[3].metrics == {NONFINITE_METRIC: 3.0}
    assert "last-known-good" in rows[1].local_reasons
    assert "last-known-good" in rows[1].remote_reasons
    assert client.latest_step() == 3 and client.latest_step(healthy=True) == 1
    tree, _ = client.restore(healthy=True)
    assert tree["w"][0] == 1 and np.isfinite(tree["w"]).all()
    assert np.isnan(client.restore()[0]["w"][0])  # asked for nothing: the newest
    with pytest.raises(FailedPrecondition, match=r"not known healthy .*3 NaN/Inf"):
        client.restore(step=3, healthy=True)
    ls = subprocess.run(
        [CKPTD, "ls", "div", "--socket", str(daemon.socket)], capture_output=True, text=True
    )
    assert ls.returncode == 0 and "nan/inf=3" in ls.stdout, ls.stdout + ls.stderr
    manifest = Manifest.from_json((daemon.root / "div" / "3" / "manifest.json").read_text())
    assert manifest.nonfinite == {"0": {"b": 1, "w": 2}}

    # The node is lost: the bucket's markers carry the health, a wiped node skips step 3.
    daemon.stop()
    shutil.rmtree(daemon.root)
    daemon.start()
    tree, _ = client.restore(healthy=True)
    assert tree["w"][0] == 1 and int(tree["n"][0]) == 1
    # Healthy again: step 1 is no longer last-known-good in either tier (only the
    # restore's grace holds it now), and step 3 is gone.
    client.save(4, _state(4)).wait("durable", 60)
    settled(client, [1, 4], [1, 4])
    step1 = next(c for c in client.list() if c.step == 1)
    assert step1.local_reasons == ("in-use",) and step1.remote_reasons == ("in-use",)


def test_healthy_restore_without_a_healthy_step_says_what_it_found(make_daemon: Any) -> None:
    daemon = make_daemon()
    client = daemon.client("sick")
    with pytest.raises(CheckpointNotFound):
        client.restore(healthy=True)
    client.save(1, _state(1, bad=1)).wait("local", 60)
    with pytest.raises(CheckpointNotFound, match=r"known healthy.*step 1 \(2 NaN/Inf"):
        client.restore(healthy=True)
    with pytest.raises(ValueError, match="set by the daemon"):
        client.save(2, _state(2), metrics={NONFINITE_METRIC: 0.0})
    # A raw request naming the daemon's metric is refused too, with the same advice.
    with pytest.raises(grpc.RpcError) as err:
        daemon.stub().Adopt(
            pb.AdoptRequest(job="sick", step=5, path="/nowhere", metrics={"ckptd.x": 1.0}),
            metadata=META,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "set by the daemon" in err.value.details()
