"""One commit protocol: write under a temporary location, then one commit point.

Nothing is visible in a tier until its commit point (docs/architecture.md,
"Crash-consistency rules" 1-2). ckptd commits in four places, all through this
protocol (Orbax's ``TemporaryPath``: create, write, finalize):

- the local tier: a step's staging directory renamed to ``<root>/<job>/<step>``
  (:class:`RenameCommit`, ``manifest.json`` the last file in it);
- a download from the bucket, and another node's part, installed the same way;
- the drain: a node's objects under ``<job>/<step>/<node>/`` and the
  ``_complete/<node>`` marker last (:class:`MarkerCommit`);
- an adopted tree published where its framework reads it: on object stores in
  place with ``commit_success.txt`` last (:class:`MarkerCommit`), on ``file://``
  built aside and renamed into place (:class:`RenameCommit`); and put back into a
  watched directory for a restore (:class:`RenameCommit`).

``tests/test_commit_protocol.py`` runs one conformance suite on each.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import os
import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from ckptd.core.errors import Conflict

from . import faults
from .files import fsync_dir, write_synced

Runner = Callable[..., Awaitable[Any]]
"""Runs a blocking function off the event loop (``IoPool.run`` or ``asyncio.to_thread``)."""

FILES_DIR = "files"
"""Where an adopted tree sits inside ckptd's own step directory (beside manifest.json)."""
COMMIT_FILE = "commit_success.txt"
"""Orbax's commit point on object stores: uploaded after every other file of the tree."""


class ObjectStore(Protocol):
    """What a :class:`MarkerCommit` needs of a bucket (``remote.base.Remote`` is one).

    Stated here, beneath the tiers, so the protocol does not import the remote tier
    that implements it."""

    async def put_bytes(self, key: str, data: bytes) -> None:
        """Write one small object."""

    async def delete(self, keys: list[str]) -> None:
        """Delete these objects (missing ones are not an error)."""

    async def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``."""

    async def exists(self, key: str) -> bool:
        """Whether the object exists."""


class Commit(abc.ABC):
    """A commit in progress: write the pieces at :attr:`location`, then :meth:`finalize`."""

    final: str
    """Where the committed result is visible (a path, or a key prefix)."""
    location: str
    """Where to write the pieces before the commit point."""

    @abc.abstractmethod
    async def finalize(self, marker: bytes | None = None) -> None:
        """The commit point: write ``marker`` last (if given) and make everything visible."""

    @abc.abstractmethod
    async def abort(self) -> None:
        """Give up: nothing becomes visible, and what was staged is removed."""

    @abc.abstractmethod
    async def committed(self) -> bool:
        """Whether readers see the result (the rule readers go by, for tests and checks)."""


class RenameCommit(Commit):
    """A directory on a POSIX filesystem: built under a temporary name on the same
    filesystem, every directory in it fsynced, renamed into place, parent fsynced.

    ``marker``: the name of the file ``finalize`` writes last inside it.
    ``replace``: an existing final directory is swapped out (a retried publish);
    otherwise it is a :class:`Conflict`. ``location``: how writers name the
    temporary directory, when not by its path (a ``file://`` bucket's key).
    """

    def __init__(
        self,
        final: Path,
        tmp: Path,
        marker: str = "",
        *,
        replace: bool = False,
        run: Runner = asyncio.to_thread,
        fault: str = "",
        location: str = "",
        marker_mode: int = 0o640,
    ) -> None:
        self.path = tmp
        self.final_path = final
        self.final, self.location = str(final), location or str(tmp)
        self.marker = marker
        self.replace = replace
        self._run = run
        self._fault = fault
        self._marker_mode = marker_mode

    @classmethod
    def beside(
        cls, final: Path, tmp_dir: Path, name: str, make: bool = True, **kw: Any
    ) -> RenameCommit:
        """A commit whose temporary directory ``tmp_dir/<name>.<token>`` is created now
        (``tmp_dir`` must be on the final directory's filesystem); ``make=False``: by
        :meth:`make` later, off the caller's thread."""
        tmp = tmp_dir / f"{name}.{secrets.token_hex(4)}"
        commit = cls(final, tmp, **kw)
        if make:
            commit.make()
        return commit

    def make(self) -> None:
        """Create the temporary directory (blocking; idempotent). On a disk busy with a
        large write a directory's creation can wait for the filesystem's journal for
        half a second: never on the event loop of a save's acknowledgement."""
        self.path.mkdir(mode=0o750, parents=True, exist_ok=True)

    async def finalize(self, marker: bytes | None = None) -> None:
        """Write the marker, fsync the tree, rename it into place, fsync the parent."""
        await self._run(self._finalize, marker)

    def _finalize(self, marker: bytes | None) -> None:
        if not self.path.is_dir():  # never publish an empty tree in its place
            raise OSError(
                errno.EAGAIN,
                f"{self.path} vanished before its commit; the next attempt rewrites it",
            )
        if marker is not None:
            (self.path / self.marker).unlink(missing_ok=True)  # an earlier attempt's
            write_synced(self.path / self.marker, marker, self._marker_mode)
        for d, _, _ in sorted(os.walk(self.path), key=lambda t: -len(Path(t[0]).parts)):
            fsync_dir(Path(d))
        parent = self.final_path.parent
        if not parent.exists():
            parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            fsync_dir(parent.parent)
        old = None
        if self.final_path.exists():
            if not self.replace:
                raise Conflict(f"{self.final_path} is already committed")
            old = self.path.with_name(f"{self.path.name}.replaced-{secrets.token_hex(4)}")
            os.rename(self.final_path, old)
        if self._fault:
            faults.hit(self._fault)
        os.rename(self.path, self.final_path)
        fsync_dir(parent)
        if self._fault:
            faults.hit(self._fault.replace(".before_", ".after_"))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    async def abort(self) -> None:
        """Remove the temporary directory."""
        await self._run(shutil.rmtree, self.path, True)

    async def committed(self) -> bool:
        """The final directory exists (a rename is all or nothing)."""
        return bool(await self._run(self.final_path.is_dir))


class MarkerCommit(Commit):
    """Objects written in place under a prefix; readers count them only once the
    marker object exists, and ``finalize`` writes it last."""

    def __init__(self, remote: ObjectStore, prefix: str, marker_key: str) -> None:
        self.remote = remote
        self.final = self.location = prefix
        self.marker_key = marker_key

    async def finalize(self, marker: bytes | None = None) -> None:
        """Write the marker object (nothing to do without one: the objects are in place)."""
        if marker is not None:
            await self.remote.put_bytes(self.marker_key, marker)

    async def abort(self) -> None:
        """Delete the marker first, then every object under the prefix."""
        await self.remote.delete([self.marker_key])
        await self.remote.delete(await self.remote.list_keys(self.location + "/"))

    async def committed(self) -> bool:
        """The marker object exists."""
        return await self.remote.exists(self.marker_key)
