"""``ckptd serve``: the process lifecycle around the servicer.

Takes the socket and root locks, recovers the local tier, opens and checks the
remote tier, wires the drain and the evictor, listens on a 0660 unix socket and
on SIGTERM stops taking requests, finishes acknowledged work and exits.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import grpc

from ckptd.proto import ckptd_pb2_grpc as pb_grpc

from . import __version__
from .adopt import Adopter
from .config import Config
from .drain import Drain
from .evictor import Evictor
from .node import Node, StepState
from .remote import Remote
from .remote_backends import open_remote
from .server import Servicer

log = logging.getLogger("ckptd.server")


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


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


def _prepare_socket_dir(socket: Path) -> None:
    parent = socket.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o750)
        os.chmod(parent, 0o750)  # mkdir's mode is narrowed by the umask; set it exactly


async def _start_remote(config: Config, node: Node) -> tuple[Remote | None, Drain | None]:
    """Open and check the remote tier: one clear error at start-up, not a stack of retries."""
    if not config.remote:
        log.warning(
            "no remote tier configured: checkpoints live only on this node's disk "
            'and die with it (set remote = "s3://..." or "gs://...")'
        )
        return None, None
    try:
        remote = open_remote(
            config.remote,
            config.remote_endpoint_url,
            config.part_size_bytes,
            config.drain_concurrency,
        )
        await asyncio.wait_for(remote.check(), 30)
        drain = Drain(node, remote, config.drain_retry_max_seconds)
        await asyncio.wait_for(drain.resume(), 120)
    except ImportError as exc:
        raise StartupError(
            f"remote {config.remote} needs {exc.name}: pip install 'ckptd[s3]' or 'ckptd[gcs]'"
        ) from None
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = "no answer within 30 s (check the endpoint and the network)"
        raise StartupError(f"cannot use remote {config.remote}: {reason}") from None
    return remote, drain


async def serve(config: Config, on_ready: Callable[[], None] | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT, then finish acknowledged saves and exit."""
    try:
        _prepare_socket_dir(config.socket)
        config.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"cannot create {exc.filename}: {exc.strerror}") from None
    sock_lock = _take_lock(
        config.socket.with_name(config.socket.name + ".lock"), str(config.socket)
    )
    root_lock = _take_lock(config.root / ".lock", f"root {config.root}")
    node = Node(config)
    await node.start()
    remote, drain = await _start_remote(config, node)
    # The lock proves no live daemon owns the socket: a file there is stale.
    config.socket.unlink(missing_ok=True)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 256 * 2**20),
            ("grpc.max_send_message_length", 256 * 2**20),
        ]
    )
    evictor = Evictor(node, remote)
    if drain is not None:
        drain.wants = evictor.remote_wants

        def durable(st: StepState) -> None:
            evictor.mark_superseded(st.job)  # at once: waiters learn it without a pass
            evictor.kick()

        drain.on_durable.append(durable)
    adopter = Adopter(node)
    await adopter.load()
    servicer = Servicer(node, remote, drain, evictor, adopter)
    pb_grpc.add_CkptdServicer_to_server(servicer, server)
    drain_task = asyncio.create_task(drain.run()) if drain else None
    evictor.kick()  # apply the retention to what recovery found
    evictor_task = asyncio.create_task(evictor.run())
    adopter_task = asyncio.create_task(adopter.run())
    old_umask = os.umask(0o117)  # the socket is born 0660, never briefly wider
    try:
        server.add_insecure_port(f"unix:{config.socket}")
        await server.start()
    finally:
        os.umask(old_umask)
    os.chmod(config.socket, 0o660)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "ckptd %s serving on %s (root %s, node %s, pid %d)",
        __version__,
        config.socket,
        config.root,
        config.node_id,
        os.getpid(),
    )
    if on_ready:
        on_ready()
    await stop.wait()
    log.info("stopping: no new requests; finishing acknowledged saves")
    node.stopping.set()
    await server.stop(grace=5)
    evictor.stop()
    adopter.stop()
    await evictor_task
    await adopter_task
    if drain is not None and drain_task is not None:
        drain.stop()
        await drain_task
    if remote is not None:
        await remote.close()
    await node.close()
    config.socket.unlink(missing_ok=True)
    os.close(root_lock)
    os.close(sock_lock)
    log.info("stopped")
