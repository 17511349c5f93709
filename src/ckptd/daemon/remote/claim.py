"""A node name is claimed in the bucket before the daemon writes under it.

Two daemons configured with the same ``node_id`` on one bucket prefix would write
the same keys (rank files, markers, the node's index) and silently replace each
other's steps. So the name is claimed by one object, ``_nodes/<node>/instance``,
written only with the store's compare-and-swap (:meth:`Remote.write_if`: S3
``If-None-Match``/``If-Match``, GCS ``ifGenerationMatch``, file:// exclusive
links). It records which daemon holds the name (an instance id random at each
start, the host, pid and start time, and the id of the daemon's root) and a
heartbeat time the holder refreshes every ``node_claim_heartbeat_seconds``.

A daemon takes the claim when it is absent, or held by:

- the same root (a restart of the same daemon: its root id is kept in the root),
- a holder that released it (a clean stop),
- a holder that was a process of this very host's current boot and pid namespace
  and is no longer running (a daemon SIGKILLed or crashed here, then started on a
  new disk: same boot id, namespace and pid, and the pid's start time differs or
  the pid is gone; a twin on another host never matches, since its boot id differs),
- a holder whose heartbeat is older than ``node_claim_stale_seconds`` and two of
  the holder's own heartbeat intervals (by this daemon's clock: hosts' clocks must
  agree within that margin), or
- anyone, once, when the operator says so (``node_claim_takeover``).

The claim also keeps the node name's record, which outlives the node's disk (the
daemon's own job record dies with it): when the name was first claimed
(``since_unix``) and how often a new root took it over from a holder that had not
released it (``replacements``: the node was lost and replaced, with a fresh disk;
the newest :data:`REPLACED_KEPT` times in ``replaced_unix``). A restart on the same
root and a clean release then a new root (a planned move) are not counted. Each
write carries the record forward, so it costs no request of its own; node_fleet.py
samples it to learn the node-loss rate that ``Goodput()`` saves for.

Anyone who may write the bucket may write this object too, so a record is read
only with every field of its type and in range (remote/records.py): one that is
not is not ckptd's, is logged once and counts as unreadable (taken over at once,
its history started afresh), so a poisoned claim of this node's own name never
stops its uploads, and the record it writes back carries nothing of the poison.

Every takeover is a conditional write on the version it read, so of two daemons
racing for a stale claim only one wins. One that does not hold the claim keeps
saving to its local disk but uploads and deletes nothing in the bucket; its
status says which host holds the name and what to do. A holder whose heartbeat
write fails its precondition has lost the claim (taken over while it was
unreachable or paused) and stops writing too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.names import MAX_NODE_BYTES
from ckptd.core.redact import redact

from ..files import read_small, replace_synced
from ..local.liveness import process_start
from . import records
from .base import Remote
from .records import MAX_COUNT, OutOfBounds, integer, seconds, text

log = logging.getLogger("ckptd.claim")

CLAIM_DIR = "_nodes"
RETRY_SECONDS = 30.0
"""Longest wait between two attempts to take a claim this daemon does not hold."""
REPLACED_KEPT = 32
"""Replacement times a claim keeps (the newest)."""
MAX_CLAIM_BYTES = 64 * 2**10
"""Largest claim object read as one (a record ckptd writes is a few hundred bytes)."""
ROOT_ID_FILE = ".node-claim-id"
"""The root's id, kept in the root: a restart of the same daemon retakes its claim."""


def claim_key(node: str) -> str:
    """The key of a node name's claim, relative to the remote root."""
    return f"{CLAIM_DIR}/{node}/instance"


@dataclass
class ClaimRecord:
    """What the claim object holds (JSON)."""

    node: str
    instance: str
    root_id: str
    host: str
    pid: int
    started_unix: float
    heartbeat_unix: float
    heartbeat_seconds: float = 0.0
    """The holder's heartbeat interval: its claim is never stale before two of them."""
    released: bool = False
    boot_id: str = ""
    """The holder host's boot id (``/proc/sys/kernel/random/boot_id``)."""
    pid_ns: int = 0
    """The inode of the holder's pid namespace: its pid means something only there."""
    pid_started: int = -1
    """The holder process's start time (clock ticks after boot): with the pid, a name
    no later process has."""
    since_unix: float = 0.0
    """When the node name was first claimed (a record without it: its start time)."""
    replacements: int = 0
    """Takeovers by a new root of a claim its holder had not released: node losses."""
    replaced_unix: list[float] = field(default_factory=list)
    """When the newest :data:`REPLACED_KEPT` replacements happened, oldest first."""

    def to_bytes(self) -> bytes:
        """The record as stored."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, node: str | None = None) -> ClaimRecord | None:
        """A stored record, or None if it is not one ckptd writes (then it counts as
        stale): every field of the right type and in range (remote/records.py).
        ``node``: the name whose claim it was read as; a record of another name is
        not one, and a record that is not one is then logged once."""
        try:
            if len(data) > MAX_CLAIM_BYTES:
                raise OutOfBounds(f"{len(data)} bytes, more than any claim")
            rec = cls._checked(json.loads(data))
            if node is not None and rec.node != node:
                raise OutOfBounds(f"the claim of node {rec.node!r}, read as {node!r}'s")
            return rec
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            if node is not None:
                records.skipped(claim_key(node), f"not a node name's claim: {exc}")
            return None

    @classmethod
    def _checked(cls, raw: dict[str, Any]) -> ClaimRecord:
        """The record from its JSON, each field checked (OutOfBounds, KeyError)."""
        if not isinstance(raw, dict):
            raise OutOfBounds("not a JSON object")
        started = seconds(raw["started_unix"], "started_unix")
        if type(raw.get("released", False)) is not bool:
            raise OutOfBounds("released is not true or false")
        times = raw.get("replaced_unix", [])
        if not isinstance(times, list) or len(times) > REPLACED_KEPT:
            raise OutOfBounds(f"replaced_unix is not a list of at most {REPLACED_KEPT} times")
        return cls(
            node=text(raw["node"], "node", MAX_NODE_BYTES),
            instance=text(raw["instance"], "instance"),
            root_id=text(raw["root_id"], "root_id"),
            host=text(raw["host"], "host"),
            pid=integer(raw["pid"], "pid", 0, 2**31),
            started_unix=started,
            heartbeat_unix=seconds(raw["heartbeat_unix"], "heartbeat_unix"),
            heartbeat_seconds=seconds(raw.get("heartbeat_seconds", 0.0), "heartbeat_seconds"),
            released=raw.get("released", False),
            boot_id=text(raw.get("boot_id", ""), "boot_id"),
            pid_ns=integer(raw.get("pid_ns", 0), "pid_ns", 0, 2**64),
            pid_started=integer(raw.get("pid_started", -1), "pid_started", -1, 2**63),
            # Written before the record had a history: it starts at the holder's start.
            since_unix=seconds(raw.get("since_unix", 0.0), "since_unix") or started,
            replacements=integer(raw.get("replacements", 0), "replacements", 0, MAX_COUNT),
            replaced_unix=[seconds(t, "replaced_unix") for t in times],
        )

    def carry(self, prev: ClaimRecord | None, replaced: bool, now: float) -> None:
        """Take the node name's record over from ``prev`` (None: the name starts
        afresh, at ``now``), one replacement more if ``replaced``."""
        if prev is None:
            self.since_unix, self.replacements, self.replaced_unix = now, 0, []
            return
        self.since_unix = prev.since_unix
        # Saturated: a record this daemon writes is always one the next reader takes.
        self.replacements = min(prev.replacements + replaced, MAX_COUNT - 1)
        times = [*prev.replaced_unix, now] if replaced else prev.replaced_unix
        self.replaced_unix = times[-REPLACED_KEPT:]

    def describe(self) -> str:
        """Who holds the claim, for messages."""
        return f"host {self.host} (pid {self.pid}, started {time.ctime(self.started_unix)})"


def _boot_id() -> str:
    try:
        return read_small(Path("/proc/sys/kernel/random/boot_id")).decode().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def root_id(root: Path) -> str:
    """The root's persistent id (made on first use)."""
    path = root / ROOT_ID_FILE
    try:
        return read_small(path).decode().strip()
    except FileNotFoundError:
        value = secrets.token_hex(16)
        replace_synced(path, value.encode(), 0o640)
        return value


class NodeClaim:
    """This daemon's claim on its node name in the bucket; :attr:`held` gates every
    write there (the drain, the remote evictions)."""

    def __init__(
        self,
        remote: Remote,
        node: str,
        root_id: str,
        heartbeat_seconds: float,
        stale_seconds: float,
        takeover: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.remote = remote
        self.key = claim_key(node)
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_seconds = stale_seconds
        self.clock = clock
        self._takeover = takeover
        now = clock()
        self.mine = ClaimRecord(
            node,
            secrets.token_hex(8),
            root_id,
            socket.gethostname(),
            os.getpid(),
            now,
            now,
            heartbeat_seconds,
            since_unix=now,
            boot_id=_boot_id(),
            pid_ns=_pid_ns(),
            pid_started=process_start(os.getpid()) or -1,
        )
        self.held = False
        self.reason = "the node name's claim in the bucket is not taken yet"
        """Why the claim is not held and what to do (empty while it is held)."""
        self.holder: ClaimRecord | None = None
        """The other daemon holding the name, if one does."""
        self.changed = asyncio.Event()
        """Set whenever :attr:`held` changes (the drain waits on it)."""
        self._version: str | None = None
        self._stop = asyncio.Event()

    def _set(self, held: bool, reason: str = "") -> None:
        if held != self.held:
            self.changed.set()
        self.held, self.reason = held, reason

    def _stale(self, rec: ClaimRecord) -> bool:
        # The holder may beat more slowly than this daemon's setting expects.
        limit = max(self.stale_seconds, 2 * rec.heartbeat_seconds)
        return self.clock() - rec.heartbeat_unix > limit

    def _dead_here(self, rec: ClaimRecord) -> bool:
        """Whether ``rec``'s holder ran on this host, in this boot and pid namespace,
        and has exited: only then can this daemon know it is gone without waiting."""
        mine = self.mine
        if not mine.boot_id or rec.boot_id != mine.boot_id or rec.pid_ns != mine.pid_ns:
            return False
        if rec.pid_started < 0 or mine.pid_ns == 0:
            return False
        return process_start(rec.pid) != rec.pid_started

    async def acquire(self) -> bool:
        """One attempt to take (or keep) the claim; returns whether it is held."""
        self.mine.heartbeat_unix = self.clock()
        self.mine.released = False
        if self.held:
            new = await self.remote.write_if(self.key, self.mine.to_bytes(), self._version)
            if new is not None:
                self._version = new
                return True
        current = await self.remote.read_versioned(self.key)
        if current is None:
            self.mine.carry(None, False, self.clock())
            new = await self.remote.write_if(self.key, self.mine.to_bytes(), None)
            return self._won(new, "took the free")
        data, version = current
        rec = ClaimRecord.parse(data, self.mine.node)
        if rec is not None and rec.instance == self.mine.instance:
            self._version = version  # our own write (a retry after an unknown outcome)
            return self._won(version, "kept its")
        why = self._may_take(rec)
        if not why:
            assert rec is not None  # an unreadable record is always taken
            return self._refused(rec)
        # A new root taking a claim its holder did not give up: that node was lost.
        replaced = rec is not None and why not in ("same root's", "released")
        self.mine.carry(rec, replaced, self.clock())
        new = await self.remote.write_if(self.key, self.mine.to_bytes(), version)
        if new is not None:
            self._takeover = False
            if rec is not None and why == "stale":
                log.warning("node %s: took over the stale claim of %s", rec.node, rec.describe())
        return self._won(new, f"took the {why}")

    def _may_take(self, rec: ClaimRecord | None) -> str:
        """Which rule lets this daemon take the claim ``rec``; empty if none does."""
        if rec is None:
            return "unreadable"
        if rec.root_id == self.mine.root_id:
            return "same root's"
        if rec.released:
            return "released"
        if self._dead_here(rec):
            return "dead local process's"
        if self._stale(rec):
            return "stale"
        return "operator's takeover of the" if self._takeover else ""

    def _won(self, version: str | None, how: str) -> bool:
        if version is None:  # another daemon's conditional write came first
            self._set(False, "another daemon took the node name's claim first; retrying")
            return False
        was = self.held
        self._version = version
        self.holder = None
        self._set(True)
        if not was:
            log.info("node %s: %s claim on %s/%s", self.mine.node, how, self.remote.url, self.key)
        return True

    def _refused(self, rec: ClaimRecord) -> bool:
        lost = self.held
        new_holder = self.holder is None or self.holder.instance != rec.instance
        self.holder = rec
        age = self.clock() - rec.heartbeat_unix
        reason = (
            f"node name {rec.node!r} is held in {self.remote.url} by another daemon on "
            f"{rec.describe()}, heartbeat {age:.0f} s ago: not uploading (saves stay on the "
            f"local disk). Set node_id to a different name on one of the two, or stop the "
            f"other; a claim older than {self.stale_seconds:.0f} s (node_claim_stale_seconds) "
            "is taken over, or at once with node_claim_takeover = true"
        )
        if lost or new_holder:  # once per holder, not at every retry
            log.error("%s%s", "lost the claim: " if lost else "", reason)
        self._set(False, reason)
        return False

    async def try_acquire(self, timeout: float) -> None:
        """The start-up's attempt: a failure is not raised but kept as :attr:`reason`
        (status shows it) and logged; :meth:`run` tries again."""
        try:
            await asyncio.wait_for(self.acquire(), timeout)
        except Exception as exc:
            why = (
                "no answer within the time allowed (check the endpoint and the network)"
                if isinstance(exc, TimeoutError)
                else str(exc) or type(exc).__name__
            )
            self.reason = redact(f"cannot read the node name's claim: {why}")
            log.warning("%s", self.reason)

    async def run(self) -> None:
        """Refresh the claim every heartbeat, or retry taking it (supervised)."""
        while not self._stop.is_set():
            try:
                await self.acquire()
            except Exception as exc:
                # The store is unreachable: the claim stays as it was (a holder keeps
                # uploading, which fails on its own; the takeover rule covers the rest).
                log.warning("node claim in %s: %s", self.remote.url, exc)
                if not self.held:
                    self.reason = f"cannot read the node name's claim: {exc}"
            # Not held: look again sooner (a store that failed at start-up, a holder
            # that may release); a refused daemon is one GET per RETRY_SECONDS.
            wait = (
                self.heartbeat_seconds if self.held else min(self.heartbeat_seconds, RETRY_SECONDS)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)

    def stop(self) -> None:
        """Ask :meth:`run` to return after its current attempt."""
        self._stop.set()

    async def release(self) -> None:
        """Mark the claim released (a clean stop): a replacement takes it at once."""
        self._stop.set()
        if not self.held:
            return
        self.mine.released = True
        self.mine.heartbeat_unix = self.clock()
        try:
            await self.remote.write_if(self.key, self.mine.to_bytes(), self._version)
        except Exception as exc:  # it goes stale instead
            log.warning("could not release the node name's claim: %s", exc)
        self._set(False, "released (the daemon is stopping)")
