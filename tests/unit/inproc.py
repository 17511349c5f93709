"""An in-process daemon for the unit tier: ``ckptd serve``'s own ``serve()``, run on
an event loop in a thread of the test process, where a separate process is not
what a test is about (kills, restarts and crashes keep their subprocess suites).

It starts in a fraction of a process's time and its failures come back as the
test's own exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.daemon.app import config
from ckptd.daemon.app.serve import serve

START_SECONDS = 60.0


@dataclass
class InProcessDaemon:
    """A running in-process daemon: where to reach it, and its configuration."""

    socket: Path
    root: Path
    cfg: config.Config


@contextlib.contextmanager
def in_process_daemon(root: Path, **keys: Any) -> Iterator[InProcessDaemon]:
    """A daemon with ``root`` (and any other configuration ``keys``) served in a
    thread until the block ends, then stopped as SIGTERM would (acknowledged saves
    finished). Its socket is in a short directory of its own (unix socket paths are
    limited to 107 bytes)."""
    sockdir = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    flags = {"metrics_address": "off", "log_level": "warning", **keys}
    flags.update(root=str(root), socket=str(sockdir / "ckptd.sock"))
    cfg = config.load(None, env={}, flags=flags)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: list[asyncio.Event] = []
    failed: list[BaseException] = []

    def run() -> None:
        async def main() -> None:
            stop.append(asyncio.Event())
            await serve(cfg, on_ready=ready.set, stop=stop[0])

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # given back to the test below
            failed.append(exc)
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=run, name="ckptd-in-process", daemon=True)
    thread.start()
    try:
        if not ready.wait(START_SECONDS) or failed:
            raise RuntimeError(f"the in-process daemon did not start: {failed or 'timeout'}")
        yield InProcessDaemon(cfg.socket, cfg.root, cfg)
    finally:
        if stop and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # it ended meanwhile: its loop is closed
                loop.call_soon_threadsafe(stop[0].set)
        thread.join(START_SECONDS)
        if thread.is_alive():
            raise RuntimeError(f"the in-process daemon did not stop in {START_SECONDS:g} s")
        shutil.rmtree(sockdir, ignore_errors=True)
    if failed:
        raise failed[0]
