"""systemd's readiness protocol (``Type=notify``): ``READY=1`` once the socket takes
requests, ``STOPPING=1`` when SIGTERM arrives, sent to ``$NOTIFY_SOCKET`` if systemd
set one (nothing otherwise). The whole protocol is a datagram on a unix socket."""

from __future__ import annotations

import contextlib
import logging
import os
import socket

log = logging.getLogger("ckptd.server")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``); False when not run by systemd or on error."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)) as s:
            s.sendto(state.encode(), address)
        return True
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
