"""Downloads by ranged GETs on worker threads (daemon/remote/ranged.py).

S3 (SeaweedFS, reached through the fault proxy where a test breaks it) and GCS
(fake-gcs-server): parts land in the file and in the caller's memory, verified; a
connection cut in the middle of a part resumes where its last whole chunk ended; a
store that stays broken, or refuses, is one clean error after every part stopped;
a bucket copy with one byte changed in one range is never served.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest

from ckptd.client import CkptdError
from ckptd.core.format import round_up
from ckptd.daemon import faults
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.base import Remote, RemoteError
from ckptd.daemon.remote.ranged import ATTEMPTS, CHUNK
from ckptd.proto import ckptd_pb2 as pb

from .conftest import RemoteTarget
from .faults.proxy import FaultProxy
from .helpers import state_for
from .test_remote_tier import remote_daemon, s3_target

PART = 5 * 2**20  # two chunks per part: 4 MiB, then 1 MiB
SIZE = 3 * PART + 12345
KEY = "j/1/n/rank-00000.safetensors"


def _data(size: int = SIZE, seed: int = 7) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _run(
    url: str,
    env: dict[str, str],
    endpoint: str,
    body: Callable[[Remote], Awaitable[Any]],
    part: int = PART,
    threads: int = 4,
) -> Any:
    """``await body(remote)`` on a fresh adapter (``threads`` threads, ``part``-sized parts)."""

    async def main() -> Any:
        r = open_remote(url, endpoint, part, threads)
        try:
            return await body(r)
        finally:
            await r.close()

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return asyncio.run(main())
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_proxy(s3_server: Any, tmp_path: Path) -> Iterator[tuple[FaultProxy, Callable[..., Any]]]:
    """A bucket holding ``KEY`` (``_data()``), and a runner whose adapter reaches the store
    through a fault proxy."""
    bucket = s3_server.make_bucket(f"ckptd-ranged-{os.getpid()}-{secrets.token_hex(4)}")
    s3_server.client().put_object(Bucket=bucket, Key=f"ckpt/{KEY}", Body=_data())
    with FaultProxy(("127.0.0.1", s3_server.s3_port)) as proxy:

        def run(body: Callable[[Remote], Awaitable[Any]], **kw: int) -> Any:
            return _run(f"s3://{bucket}/ckpt", s3_server.env(), proxy.url, body, **kw)

        run.put = lambda key, data: s3_server.client().put_object(  # type: ignore[attr-defined]
            Bucket=bucket, Key=f"ckpt/{key}", Body=data
        )

        yield proxy, run


def _download_into(tmp_path: Path, name: str = "dl.bin") -> Callable[[Remote], Awaitable[Any]]:
    """A body downloading ``KEY`` into a file and page-aligned memory; returns
    ``(crc, memory bytes, threaded parts)``."""

    async def body(r: Remote) -> tuple[int, bytes, int]:
        mem = mmap.mmap(-1, round_up(SIZE))
        crc = await r.download(KEY, tmp_path / name, SIZE, memoryview(mem))
        return crc, bytes(mem[:SIZE]), r.ranged_parts

    return body


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_parts_land_in_file_and_memory_on_worker_threads(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    bucket = server.make_bucket(f"ckptd-ranged-{os.getpid()}-{secrets.token_hex(4)}")
    url = f"{'s3' if kind == 's3' else 'gs'}://{bucket}/ckpt"
    target = RemoteTarget(kind, url, server.env(), server)
    data = _data()
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    want = google_crc32c.value(data)

    async def body(r: Remote) -> tuple[int, bytes, int]:
        await r.put_file(src, KEY, SIZE, want)
        got = await _download_into(tmp_path)(r)
        with pytest.raises(FileNotFoundError):
            await r.download("j/1/n/missing", tmp_path / "missing.bin", 100)
        return got  # type: ignore[no-any-return]

    crc, memory, threaded = target.run(body, PART)
    assert crc == want
    assert memory == data
    assert (tmp_path / "dl.bin").read_bytes() == data
    assert threaded == 4  # every part by a ranged GET on a worker thread


@pytest.fixture
def chunk_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Arm the in-process failpoint after a part's first chunk; returns its directory."""
    monkeypatch.setenv(faults.DIR_VARIABLE, str(tmp_path))
    monkeypatch.setitem(faults._POINTS, "fetch.chunk", "pause")
    return tmp_path


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_connection_cut_mid_part_resumes_after_the_last_whole_chunk(
    s3_proxy: tuple[FaultProxy, Any], chunk_pause: Path, tmp_path: Path
) -> None:
    proxy, run = s3_proxy
    size = 12 * CHUNK + 4321  # far more than socket buffers hold after the first chunk
    data = _data(size, seed=3)
    run.put("big", data)

    async def body(r: Remote) -> tuple[int, bytes, int, int]:
        mem = mmap.mmap(-1, round_up(size))
        crc = await r.download("big", tmp_path / "big.bin", size, memoryview(mem))
        assert r._ranges is not None
        return crc, bytes(mem[:size]), r.ranged_parts, r._ranges.parts_resumed

    # One thread, one part: the paused part's next read meets the cut.
    t, out = _in_background(lambda: run(body, part=round_up(size), threads=1))
    faults.wait_hit(chunk_pause, "fetch.chunk", timeout=60)  # CHUNK bytes in
    proxy.set_mode("reset")  # its connection is cut
    proxy.set_mode("pass")
    faults.release(chunk_pause, "fetch.chunk")
    t.join(120)
    assert not t.is_alive()
    assert not isinstance(out[0], BaseException), out[0]
    crc, memory, threaded, resumed = out[0]
    assert crc == google_crc32c.value(data)
    assert memory == data and (tmp_path / "big.bin").read_bytes() == data
    assert (threaded, resumed) == (1, 1)  # went on from a whole chunk, not from byte 0


def test_store_broken_mid_part_is_one_transient_error_after_every_part_stopped(
    s3_proxy: tuple[FaultProxy, Any], chunk_pause: Path, tmp_path: Path
) -> None:
    proxy, run = s3_proxy
    size = 12 * CHUNK + 4321
    run.put("big", _data(size, seed=5))

    async def body(r: Remote) -> int:
        mem = mmap.mmap(-1, round_up(size))
        return await r.download("big", tmp_path / "big.bin", size, memoryview(mem))

    # Two parts of six chunks: the paused one still has five to read when the store
    # breaks, far more than socket buffers can have swallowed already.
    part = round_up(size // 2 + 1)
    t, out = _in_background(lambda: run(body, part=part, threads=2))
    faults.wait_hit(chunk_pause, "fetch.chunk", timeout=60)
    proxy.set_mode("reset")  # and it stays broken
    faults.release(chunk_pause, "fetch.chunk")
    t.join(120)
    assert not t.is_alive()
    assert isinstance(out[0], RemoteError) and out[0].transient, out[0]
    # Returned only once no thread writes: nothing is in flight on the reader.
    assert [th for th in threading.enumerate() if th.name.startswith("ckptd-fetch")] == []


@pytest.mark.parametrize(("status", "transient"), [(503, True), (403, False)])
def test_store_errors_are_classified_and_only_transient_ones_retried(
    s3_proxy: tuple[FaultProxy, Any], tmp_path: Path, status: int, transient: bool
) -> None:
    proxy, run = s3_proxy

    async def body(r: Remote) -> BaseException | None:
        await r.range_source(KEY)  # the session is up before the store turns bad
        proxy.set_mode("http_error", status=status)
        try:
            await _download_into(tmp_path)(r)
        except RemoteError as exc:
            return exc
        return None

    exc = run(body)
    assert isinstance(exc, RemoteError) and exc.transient is transient
    assert f"HTTP {status}" in str(exc)
    if transient:
        assert proxy.requests_failed >= ATTEMPTS  # retried before giving up
    else:
        assert proxy.requests_failed <= 4  # one try per part at most (4 threads)


def test_one_range_changed_in_the_bucket_is_never_served(make_daemon: Any, s3_server: Any) -> None:
    remote = s3_target(s3_server, f"ckptd-range-flip-{secrets.token_hex(3)}")
    daemon = remote_daemon(make_daemon, remote)
    client = daemon.client("flip")
    for step in (1, 2):
        client.save(step, state_for(step, 16)).wait("durable", 120)
    s3 = s3_server.client()
    bucket = remote.url.split("/")[2]
    key = next(  # the rank files' prefix: <job>/_data/<hh>/<node>/<step>/
        o["Key"]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/flip/_data/")["Contents"]
        if o["Key"].endswith("/2.0/rank-00000.safetensors")
    )
    raw = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert len(raw) > 2 * PART + CHUNK
    raw[PART + CHUNK + 17] ^= 0x40  # inside the second part's second chunk
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    assert daemon.stop() == 0
    shutil.rmtree(daemon.root)
    daemon.restart()
    client = daemon.client("flip")
    with pytest.raises(CkptdError, match="does not verify"):
        client.restore(step=2)
    tree, _ = client.restore()  # the newest step that verifies
    assert tree["w1"].tobytes() == state_for(1, 16)["w1"].tobytes()
    del tree
    assert not (daemon.root / "flip" / "2").exists()
    assert list((daemon.root / ".cache").iterdir()) == []
    assert [e.step for e in daemon.events_of(pb.STEP_EVENT_FETCHED, "flip")] == [1]
