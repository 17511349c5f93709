"""Fixtures that run a real ``ckptd serve`` process on a private root and socket."""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Four CPU devices for the jax tests; must be set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from ckptd.client import Client
from ckptd.core.wire import METADATA
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.local.staging import recorded_dir, segment_prefix
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

CKPTD = str(Path(sys.executable).with_name("ckptd"))


HANG_FACTOR = 3
"""A test still running at this many times its timeout (pytest-timeout's, which a
test blocked where no signal reaches it outlives) stops the whole run, every
thread's stack printed and the test named last: a failed run says where it hung
instead of running out CI's clock."""

_STDERR: list[int] = []
"""The terminal's stderr, taken before output capture replaces it."""


def pytest_configure(config: pytest.Config) -> None:
    _STDERR.append(os.dup(2))


def _hung(nodeid: str, seconds: float) -> None:
    fd = _STDERR[0]
    faulthandler.dump_traceback(fd, all_threads=True)
    os.write(fd, f"\n{nodeid} still running after {seconds:.0f} s: stopped\n".encode())
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    seconds = HANG_FACTOR * float(
        marker.args[0] if marker and marker.args else item.config.getini("timeout")
    )
    if seconds <= 0:  # timeout(0): pytest-timeout's "no limit"
        yield
        return
    watchdog = threading.Timer(seconds, _hung, (item.nodeid, seconds))
    watchdog.daemon = True
    watchdog.start()
    # And in C, for a test that holds the GIL while it hangs.
    faulthandler.dump_traceback_later(seconds + 60, exit=True, file=_STDERR[0])
    try:
        yield
    finally:
        watchdog.cancel()
        faulthandler.cancel_dump_traceback_later()


def short_tmpdir() -> Path:
    """A short directory for sockets (unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))


class Daemon(DaemonProcess):
    """The shared launcher plus what tests need: clients and raw stubs."""

    def __init__(
        self, root: Path, socket: Path, log: Path, extra_args: list[str], env: dict[str, str]
    ):
        super().__init__(
            root,
            socket,
            node_id="test-node",
            staging_budget="512MiB",
            extra_args=extra_args,
            env=env,
            log_path=log,
        )
        self.clients: list[Client] = []
        self.sessions: list[Any] = []

    def client(self, job: str = "job", **kw: Any) -> Client:
        """A client bound to this daemon (closed at teardown)."""
        c = Client(job, socket=self.socket, **kw)
        self.clients.append(c)
        return c

    def stub(self) -> Any:
        """A raw gRPC stub, for requests the client library would never send; every
        call carries this process's session (the daemon knows who calls)."""
        import grpc

        from ckptd.core.session import Session
        from ckptd.core.wire import CHANNEL_OPTIONS

        channel = grpc.insecure_channel(f"unix:{self.socket}", options=CHANNEL_OPTIONS)
        session = Session(str(self.socket))
        self.sessions.append(session)
        return SessionStub(pb_grpc.CkptdStub(channel), session)

    def events_of(self, kind: int, job: str = "", step: int | None = None) -> list[pb.EventRecord]:
        """Every recorded event of ``kind`` (of ``job`` and ``step`` if given)."""
        return [e for e in self.events(job) if e.kind == kind and step in (None, e.step)]


class SessionStub:
    """A stub whose calls add the session header to the metadata given."""

    def __init__(self, stub: Any, session: Any) -> None:
        self._stub, self._session = stub, session

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self._stub, method)

        def call(request: Any, metadata: Any = (), **kw: Any) -> Any:
            return fn(request, metadata=(*metadata, *self._session.metadata()), **kw)

        return call


META = METADATA
"""Metadata a well-behaved client sends with every call."""


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    """Factory for daemons (each with its own root and socket unless given)."""
    made: list[Daemon] = []
    sockdirs: list[Path] = []

    def make(
        root: Path | None = None,
        socket: Path | None = None,
        start: bool = True,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Daemon:
        if socket is None:
            sockdirs.append(short_tmpdir())
            socket = sockdirs[-1] / "run" / "ckptd.sock"
        d = Daemon(
            root or tmp_path / f"root{len(made)}",
            socket,
            tmp_path / f"daemon{len(made)}.log",
            # Tests adopt from and put back into their own tmp dirs (later flags win).
            ["--adopt-dirs", str(tmp_path), *(extra_args or [])],
            env or {},
        )
        made.append(d)
        return d.start() if start else d  # type: ignore[return-value]

    yield make
    for d in made:
        for c in d.clients:
            c.close()
        for s in d.sessions:
            s.close()
        if d.running():
            assert d.proc is not None
            d.proc.terminate()  # graceful: the daemon unlinks its shared memory
            try:
                d.proc.wait(30)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait(10)
        d.close()
        # A daemon a test SIGKILLed cannot clean up; its segments carry its root's prefix.
        for seg in Path("/dev/shm").glob(segment_prefix(d.root) + "*"):
            seg.unlink(missing_ok=True)
        seg_dir = recorded_dir(d.root)
        if seg_dir is not None:
            shutil.rmtree(seg_dir, ignore_errors=True)
    for s in sockdirs:
        shutil.rmtree(s, ignore_errors=True)


@pytest.fixture
def daemon(make_daemon: Any) -> Daemon:
    """One running daemon."""
    d: Daemon = make_daemon()
    return d


@pytest.fixture
def disk_daemon(make_daemon: Any) -> Daemon:
    """One running daemon without the memory tier: its restores read the disk (for
    tests of what the disk's copies do, which a copy kept in memory would bypass)."""
    d: Daemon = make_daemon(extra_args=["--memory-tier-steps", "0"])
    return d


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """One SeaweedFS S3 server for the whole session (buckets per test)."""
    from .servers import SeaweedS3

    with SeaweedS3() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[Any]:
    """One fake-gcs-server for the whole session."""
    from .servers import FakeGCS

    with FakeGCS() as server:
        yield server


@dataclass
class RemoteTarget:
    """A remote URL plus the environment a daemon needs to reach it."""

    kind: str
    url: str
    env: dict[str, str]
    server: Any = None

    def run(self, body: Any, part_size: int = 5 * 2**20) -> Any:
        """Run ``await body(remote)`` on a fresh adapter, with this target's environment set."""
        import asyncio

        from ckptd.daemon.remote.backends import open_remote

        async def main() -> Any:
            r = open_remote(self.url, "", part_size, 4)
            try:
                return await body(r)
            finally:
                await r.close()

        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            return asyncio.run(main())
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def object_keys(self) -> list[str]:
        """Every object key under the URL, as the store lists it (relative, sorted), less
        the daemons' node-name claims (``_nodes/``: tests/test_trust_node_claim.py)."""
        keys: list[str] = self.run(lambda r: r.list_keys(""))
        return [k for k in keys if not k.startswith("_nodes/")]


_bucket_counter = iter(range(10**6))


@pytest.fixture(params=["file", "s3", "gcs"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> RemoteTarget:
    """A fresh, empty remote location on each kind of backend."""
    kind = request.param
    if kind == "file":
        return RemoteTarget(kind, f"file://{tmp_path}/bucket", {})
    server = request.getfixturevalue(f"{kind}_server")
    bucket = server.make_bucket(f"ckptd-test-{os.getpid()}-{next(_bucket_counter)}")
    scheme = {"s3": "s3", "gcs": "gs"}[kind]
    return RemoteTarget(kind, f"{scheme}://{bucket}/ckpt", server.env(), server)
