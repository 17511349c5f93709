"""The real processes a sequence drives: one ``ckptd serve`` on its own root, a
SeaweedFS bucket behind a fault proxy (an outage is the proxy refusing), and the
operations on them that the model cannot do in-process: SIGKILL and restart, node
loss (the root and its shared memory wiped, the daemon started again under the same
node name and bucket), waiting for quiescence, listing.

:class:`Resources` lives for a whole run (SeaweedFS takes seconds to start); each
sequence gets a :class:`World` with a fresh root and its own prefix in the bucket.
"""

from __future__ import annotations

import itertools
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.client import CheckpointInfo, Client, FixedInterval
from ckptd.daemon.app.launcher import DaemonProcess
from ckptd.daemon.local.segments import recorded_dir
from ckptd.daemon.local.staging import segment_prefix
from ckptd.proto import ckptd_pb2 as pb

from ..faults.proxy import FaultProxy
from ..servers import LOOPBACK, SeaweedS3, free_port
from .processes import GROUP, USERS, User, users_available

NODE = "model-node"
PEER = "model-peer"
QUIET_TIMEOUT = 60.0
"""Longest wait for the daemon to go quiet (saves handed off, the drain idle): past it
the daemon is stuck, which is a failure of its own."""


class Stuck(AssertionError):
    """The daemon did not go quiet in time."""


class Resources:
    """One SeaweedFS server and bucket for a run, and a spare node: while a sequence
    runs, the next one's daemon starts in the background with the same settings
    (shrinking replays sequences of one configuration, so most replays find it)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.s3 = SeaweedS3().start()
        try:
            self.bucket = self.s3.make_bucket("ckptd-model")
        except BaseException:
            self.s3.close()
            raise
        self._sequences = itertools.count()
        self._spare: tuple[Settings, Node] | None = None
        self.users_missing = users_available()
        """Why the test users cannot run here ("" when they can)."""

    def node(self, settings: Settings) -> Node:
        """A node for a new sequence (its daemon starting), and a spare for the next."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[0] != settings:
            spare[1].close()
            spare = None
        node = spare[1] if spare is not None else self._new(settings)
        self._spare = (settings, self._new(settings))
        return node

    def _new(self, settings: Settings) -> Node:
        node = Node(self, next(self._sequences), settings)
        node.daemon.start(wait=False)
        return node

    def reader_env(self) -> dict[str, str]:
        """The checker reads the bucket directly, outage or not."""
        return self.s3.env()

    def close(self) -> None:
        """The spare node and the server (its data goes with it)."""
        if self._spare is not None:
            self._spare[1].close()
            self._spare = None
        self.s3.close()


class Node:
    """One node's files, daemon process and bucket prefix, and the fault proxy between
    that daemon and the bucket (an outage is the proxy refusing connections)."""

    def __init__(self, resources: Resources, n: int, settings: Settings) -> None:
        self.dir = resources.base / f"seq-{n}"
        self.url = f"s3://{resources.bucket}/seq-{n}"
        self.proxy = FaultProxy((LOOPBACK, resources.s3.s3_port)).start()
        # The test users reach the socket: through a directory they may search, in a
        # group they belong to.
        self.sockets = Path(tempfile.mkdtemp(prefix="ckm", dir="/tmp"))
        self.sockets.chmod(0o755)
        users = [] if resources.users_missing else ["--socket-group", GROUP]
        env = {
            **resources.s3.env(),
            "AWS_ENDPOINT_URL_S3": self.proxy.url,
            "AWS_ENDPOINT_URL": self.proxy.url,
        }
        peering: list[str] = []
        self.peer: DaemonProcess | None = None
        if settings.peer:
            peering, peer_args = self._peering()
            self.peer = DaemonProcess(
                self.dir / "peer-root",
                self.sockets / "peer" / "ckptd.sock",
                node_id=PEER,
                extra_args=peer_args,
                log_path=self.dir / "peer.log",
            )
            self.peer.start(wait=False)
        self.daemon = DaemonProcess(
            self.dir / "root",
            self.sockets / "run" / "ckptd.sock",
            node_id=NODE,
            extra_args=["--remote", self.url, *users, *peering, *settings.args()],
            env=env,
            log_path=self.dir / "daemon.log",
        )

    def _peering(self) -> tuple[list[str], list[str]]:
        """The peer flags of this node's daemon and of its peer (a second daemon, with no
        bucket, that holds a replica of each job's newest step)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        token = self.dir / "peer-token"
        token.write_text(secrets.token_hex(16) + "\n")
        token.chmod(0o600)  # a token others can read is refused at start-up
        ports = [free_port(), free_port()]
        peers = ",".join(f"{LOOPBACK}:{p}" for p in ports)

        def flags(port: int) -> list[str]:
            return [
                "--peer-address", f"{LOOPBACK}:{port}",
                "--peers", peers,
                "--peer-token-file", str(token),
            ]  # fmt: skip

        return flags(ports[0]), flags(ports[1])

    def replica(self, job: str, step: int) -> Path | None:
        """The directory of the peer's replica of ``job``/``step`` (None: no peer)."""
        if self.peer is None:
            return None
        return self.peer.root / ".replicas" / job / NODE / str(step)

    def replicas(self, job: str) -> dict[int, tuple[int, dict[str, Any]]]:
        """The peer's replicas of this node's steps of ``job``: step -> (timeline,
        metadata), as their manifests say (none without a peer)."""
        where = None if self.peer is None else self.peer.root / ".replicas" / job / NODE
        out: dict[int, tuple[int, dict[str, Any]]] = {}
        for d in sorted(where.iterdir()) if where is not None and where.is_dir() else []:
            if d.name.isdigit() and (d / "manifest.json").is_file():
                m = json.loads((d / "manifest.json").read_text())
                out[int(d.name)] = (int(m.get("timeline", 0)), dict(m.get("metadata") or {}))
        return out

    def clean_shm(self) -> None:
        """The root's shared-memory segments (a killed daemon cannot remove them)."""
        _remove_shm(self.daemon.root)

    def close(self) -> None:
        """The daemon stopped, its shared memory and files removed, the proxy closed."""
        self.proxy.set_mode("pass")  # a stopping daemon may still talk to the bucket
        self.daemon.close()
        if self.peer is not None:
            self.peer.close()
            _remove_shm(self.peer.root)
        self.clean_shm()
        self.proxy.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


def _remove_shm(root: Path) -> None:
    """The root's shared memory: segments under its prefix and its recorded directory."""
    for seg in Path("/dev/shm").glob(segment_prefix(root) + "*"):
        seg.unlink(missing_ok=True)
    seg_dir = recorded_dir(root)
    if seg_dir is not None:
        shutil.rmtree(seg_dir, ignore_errors=True)


@dataclass(frozen=True)
class Settings:
    """The daemon's configuration for one sequence: small, so the model knows exactly
    what must stay."""

    keep: int = 2
    """``retention_remote = KeepLatest(keep)``: the rule the model checks."""
    local_keep: int = 1
    """``retention_local = KeepLatest(local_keep)``, at most ``keep``."""
    memory_steps: int = 1
    """``memory_tier_steps`` (0: no memory tier)."""
    pressure: bool = False
    """A low watermark no disk meets: the evictor is always short of space and takes
    every local copy the bucket holds that it may (never the newest)."""
    peer: bool = False
    """A second daemon as this node's peer: it holds a replica of each job's newest
    step (the peer tier)."""

    def args(self) -> list[str]:
        """``ckptd serve`` flags."""
        return [
            "--retention-remote",
            f"KeepLatest({self.keep})",
            "--retention-local",
            f"KeepLatest({min(self.local_keep, self.keep)})",
            "--memory-tier-steps",
            str(self.memory_steps),
            "--local-low-watermark",
            "99%" if self.pressure else "1%",
            "--local-floor",
            "0",
            "--drain-retry-max-seconds",
            "0.5",
            "--part-size-bytes",
            "5MiB",
            # A root wiped and started again is the node name's new holder at once.
            "--node-claim-takeover",
        ]


class World:
    """One sequence's node and its trainers' clients."""

    def __init__(self, resources: Resources, settings: Settings) -> None:
        self.resources = resources
        self.settings = settings
        self.node = resources.node(settings)
        self.daemon = self.node.daemon
        self.url = self.node.url
        self.bucket_up = True
        self.clients: list[Client] = []
        self.users: dict[int, User] = {}

    def user(self, n: int) -> User:
        """Test user ``n``'s trainer process (started on first use)."""
        if n not in self.users:
            self.users[n] = User(USERS[n], self.daemon.socket)
        return self.users[n]

    # -- processes -------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon (or wait for the spare's) until it answers. During a bucket
        outage a daemon refuses to start (it checks its bucket first: app/startup.py);
        that refusal is checked, then the outage ends and the daemon starts."""
        if self.node.peer is not None and self.node.peer.running():
            self.node.peer.wait_ready()
        if self.daemon.running():
            self.daemon.wait_ready()
            return
        if not self.bucket_up:
            try:
                self.daemon.start()
            except RuntimeError as exc:
                if "cannot use remote" not in str(exc):
                    raise
            else:
                raise AssertionError("the daemon started while its bucket was unreachable")
            self.set_bucket(True)
        self.daemon.start()
        if self.node.peer is not None:
            self.prestaged()

    def prestaged(self, timeout: float = QUIET_TIMEOUT) -> None:
        """Wait until the started daemon has asked its peers for its steps (and taken
        back what it takes): until then a listing may not show them yet."""
        deadline = time.monotonic() + timeout
        while self.daemon.status().peer_prestaging:
            if time.monotonic() > deadline:
                raise Stuck(
                    f"still taking steps back from the peer after {timeout:.0f} s\n"
                    f"{self.daemon.log_tail(30)}"
                )
            time.sleep(0.01)

    def client(self, job: str, incremental: bool = True) -> Client:
        """A trainer's client of ``job`` (closed with the world)."""
        c = Client(
            job,
            socket=self.daemon.socket,
            policy=FixedInterval(1),  # no upload pace: the drain goes idle when done
            incremental=incremental,
            supersede=True,  # a burst's older saves may be superseded (machine.save_next)
        )
        self.clients.append(c)
        return c

    def restart(self, how: str, down: Callable[[], None] = lambda: None) -> None:
        """``kill`` (SIGKILL) or ``stop`` (SIGTERM) the daemon and start it again on the
        same root, or ``wipe``: the node dies with its disk and memory (SIGKILL, the root
        and its shared memory removed) and a new daemon takes the same name and bucket.
        ``down`` is called while no daemon runs."""
        if how == "stop":
            self.daemon.stop()
        else:
            self.daemon.kill()
        down()
        if how == "wipe":
            self.node.clean_shm()
            shutil.rmtree(self.daemon.root)
        self.start()

    def set_peer(self, up: bool) -> None:
        """The peer node is lost (SIGKILL; its disk stays) or comes back."""
        peer = self.node.peer
        if peer is None or peer.running() == up:
            return
        if up:
            peer.start()
        else:
            peer.kill()

    def set_bucket(self, up: bool) -> None:
        """An outage (the proxy refuses connections) or its end."""
        self.node.proxy.set_mode("pass" if up else "refuse")
        self.bucket_up = up

    def close(self) -> None:
        """Clients closed, the node gone."""
        for c in self.clients:
            c.close()
        self.clients.clear()
        for u in self.users.values():
            u.close()
        self.users.clear()
        self.node.close()

    # -- what the checks read ------------------------------------------------------------
    def quiesce(self, timeout: float = QUIET_TIMEOUT) -> pb.DaemonStatus:
        """Wait until no save is in flight and, with the bucket up, the drain is idle."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.daemon.status()
            busy = status.saves_in_flight or (self.bucket_up and status.drain_queue)
            if not busy:
                return status
            if time.monotonic() > deadline:
                raise Stuck(
                    f"the daemon is not quiet after {timeout:.0f} s: {status.saves_in_flight} "
                    f"saves in flight, drain queue {status.drain_queue}, drain error "
                    f"{status.drain_error!r}\n{self.daemon.log_tail(30)}"
                )
            time.sleep(0.01)

    def listing(self, job: str) -> dict[int, CheckpointInfo]:
        """The job's steps with a copy in some tier, by number."""
        resp = self.daemon.connection.list_checkpoints(pb.ListCheckpointsRequest(job=job))
        rows = (CheckpointInfo.of(c) for c in resp.checkpoints)
        return {c.step: c for c in rows if c.tiers}
