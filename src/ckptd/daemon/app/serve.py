"""``ckptd serve``: the process lifecycle around the servicer.

Takes the socket and root locks, builds the daemon (compose.py: recovery, the
remote tier, every service), listens on a 0660 unix socket and on SIGTERM stops
taking requests, finishes acknowledged work and exits. A background service
that keeps crashing stops the daemon the same way, with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pwd
import resource
import signal
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from ckptd.core.wire import CHANNEL_OPTIONS
from ckptd.proto import ckptd_pb2 as pb
from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from .. import __version__
from ..api.servicer import Servicer
from ..api.sessions import SessionServer
from .compose import Daemon
from .config import DEFAULT_METRICS_ADDRESS, Config
from .config_fields import MetricsOptions
from .http import HealthServer, parse_address
from .notify import notify
from .options import Options
from .startup import StartupError

log = logging.getLogger("ckptd.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Ckptd"].full_name
"""The name gRPC health checks ask about (``ckptd.v1.Ckptd``); "" is the whole server."""

__all__ = ["StartupError", "serve"]


def _take_lock(path: Path, what: str) -> int:
    """flock ``path`` for the daemon's lifetime; refuse to start if a live daemon holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"another ckptd (pid {holder}) is already serving {what}; stop it first or "
            "choose another --socket/--root"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _check_writable(directory: Path, key: str) -> None:
    """Refuse, in one line that says what to fix, a directory (or, if it does not exist
    yet, the parent it would be made in) this user cannot write: the usual cause is a
    root-owned hostPath volume and a daemon running as another uid."""
    target = directory
    while not target.exists() and target != target.parent:
        target = target.parent
    if os.access(target, os.W_OK | os.X_OK):
        return
    st = target.stat()
    uid, gid = os.geteuid(), os.getegid()
    try:
        who = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        who = f"uid {uid}"
    raise StartupError(
        f"{key} {directory}: {target} is owned by uid {st.st_uid} gid {st.st_gid} with mode "
        f"{stat.S_IMODE(st.st_mode):04o} and this daemon runs as {who}, so it cannot write "
        f"there; give the directory to that user (chown {uid}:{gid} {target}; for a "
        "Kubernetes hostPath, a tmpfiles.d entry on the node as deploy/k8s/node.tmpfiles "
        f"has, or runAsUser matching its owner) or set {key} to a directory it may write"
    )


def _prepare_socket_dir(socket: Path, group: int) -> None:
    parent = socket.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o750)
        os.chmod(parent, 0o750)  # mkdir's mode is narrowed by the umask; set it exactly
        if group >= 0:
            os.chown(parent, -1, group)


def _prepare_root(root: Path) -> None:
    """Create the root 0750; narrow an existing one that every user may enter."""
    if not root.exists():
        root.mkdir(parents=True, mode=0o750)
        os.chmod(root, 0o750)
        return
    st = root.stat()
    if st.st_mode & 0o007 and st.st_uid == os.geteuid():
        log.warning("root %s was open to every user; narrowing it to 0750", root)
        os.chmod(root, st.st_mode & 0o750)


def _raise_fd_limit() -> None:
    """Soft fd limit up to the hard one: sessions, rank files and sockets share it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _start_http(options: MetricsOptions, daemon: Daemon) -> HealthServer | None:
    """Serve /metrics, /healthz and /readyz where configured (``metrics_address``)."""
    address = parse_address(options.metrics_address)
    if address is None:
        return None
    http = HealthServer(daemon.metrics.exposition, daemon.unhealthy)
    try:
        await http.start(*address)
    except OSError as exc:
        if options.metrics_address != DEFAULT_METRICS_ADDRESS:
            raise StartupError(
                f"cannot serve metrics on {options.metrics_address}: {exc.strerror}; set "
                "metrics_address to a free HOST:PORT (port 0: any free port) or off"
            ) from None
        log.warning(
            "metrics and health endpoints are off: %s is taken (%s), probably by another "
            "ckptd on this host; give each daemon its own metrics_address",
            options.metrics_address,
            exc.strerror,
        )
        return None
    daemon.serves_metrics(http.address)
    log.info("metrics on http://%s/metrics (and /healthz, /readyz)", http.address)
    return http


async def serve(
    config: Config,
    on_ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the daemon until SIGTERM/SIGINT, then finish acknowledged saves and exit.

    ``stop``: set it to stop instead (no signal handlers are installed: a daemon run
    in a thread of another program, the unit tier's in-process daemon).
    Raises :class:`StartupError` if it cannot start, or if a background service
    kept crashing (after finishing the saves it had acknowledged).
    """
    _raise_fd_limit()
    options = Options.of(config)
    api = options.api
    group = api.socket_gid
    _check_writable(config.root, "root")
    _check_writable(config.socket.parent, "socket")
    try:
        _prepare_socket_dir(config.socket, group)
        _prepare_root(config.root)
    except OSError as exc:
        raise StartupError(f"cannot create {exc.filename}: {exc.strerror}") from None
    sock_lock = _take_lock(
        config.socket.with_name(config.socket.name + ".lock"), str(config.socket)
    )
    root_lock = _take_lock(config.root / ".lock", f"root {config.root}")
    signals = stop is None
    stopping = asyncio.Event() if stop is None else stop
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        log.error("%s", reason)
        fatal.append(reason)
        stopping.set()

    # Every service is built before anything serves (compose.py: one phase).
    daemon = Daemon(config, on_fatal, options=options)
    access = daemon.access
    sessions = SessionServer(
        config.socket,
        {"lease": access.open_lease, "file": access.open_file},
        access.forget,
        on_process_gone=daemon.process_gone,
        idle_seconds=options.local.lease_timeout_seconds,
        per_uid=api.sessions_per_uid,
        exempt=access.operators,
    )
    servicer = Servicer(daemon.services(), sessions)
    # Probes answer from the start: healthy (the loop runs), not ready while recovering.
    http = await _start_http(options.metrics, daemon)
    await daemon.start()
    # The lock proves no live daemon owns the socket: a file there is stale.
    config.socket.unlink(missing_ok=True)
    try:
        await sessions.start(group)  # before the gRPC socket: every call needs a session
    except OSError as exc:
        raise StartupError(f"cannot listen on {sessions.path}: {exc.strerror}") from None
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    pb_grpc.add_CkptdServicer_to_server(servicer, server)
    health = HealthServicer()  # grpc.health.v1: "" and "ckptd.v1.Ckptd"
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    old_umask = os.umask(0o117)  # the socket is born 0660, never briefly wider
    try:
        server.add_insecure_port(f"unix:{config.socket}")
        await server.start()
    finally:
        os.umask(old_umask)
    os.chmod(config.socket, 0o660)
    if group >= 0:
        os.chown(config.socket, -1, group)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        loop.add_signal_handler(sig, stopping.set)
    log.info(
        "ckptd %s serving on %s (root %s, node %s, pid %d)",
        __version__,
        config.socket,
        config.root,
        config.node_id,
        os.getpid(),
    )
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    if http is not None:
        http.set_ready(True)
    notify(f"READY=1\nSTATUS=serving on {config.socket}\nMAINPID={os.getpid()}")
    if on_ready:
        on_ready()
    await stopping.wait()
    daemon.begin_stop()  # waiters answer at once, and no shared memory is made any more
    notify("STOPPING=1\nSTATUS=finishing acknowledged saves")
    log.info("stopping: no new requests; finishing acknowledged saves")
    if http is not None:
        http.set_ready(False)
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)
    await sessions.stop()
    await daemon.stop()
    if http is not None:
        await http.stop()
    config.socket.unlink(missing_ok=True)
    os.close(root_lock)
    os.close(sock_lock)
    log.info("stopped")
    if fatal:
        raise StartupError(fatal[0])
