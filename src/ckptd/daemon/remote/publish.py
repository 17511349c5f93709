"""Publishing one step to the bucket: its files, then its manifest, then the marker.

Files go up in parallel (an adopted tree in its framework's order, its own
commit file last), each verified against the crc32c recorded at local commit;
a step an earlier attempt may have cut short (``suspect``: failed here, or
queued again at start-up) has its files looked for first, and one already in the
bucket with the right crc32c is not sent again; a fresh step's are not looked for
(a request per file saved). The ``_complete/<node>`` marker is the commit point
(:class:`~ckptd.daemon.commit.MarkerCommit`); the step then goes into the node's
index (index.py) before the drain calls it DURABLE. :meth:`Publisher.publish` watches
the upload: with no file finished for ``stall_seconds`` (a store that hangs
never raises) it reports through ``on_stall`` and keeps waiting. The drain
(drain.py) decides what to publish and when to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Set
from functools import partial
from typing import Any

from ckptd.core import checksum
from ckptd.core.manifest import Manifest
from ckptd.core.verify import verify_step

from .. import faults
from ..catalog import Step
from ..commit import Commit, MarkerCommit
from ..io import IoPool, gather_all
from ..local.store import LocalStore
from . import held
from .base import Remote
from .errors import RemoteError
from .index import Entry, NodeIndex
from .layout import (
    COMMIT_FILE,
    FILES_DIR,
    data_prefix,
    file_key,
    manifest_key,
    marker_key,
    ranks_key,
    record_prefix,
    step_prefix,
    tree_path,
    upload_order,
)

log = logging.getLogger("ckptd.drain")


class HolderMissing(RuntimeError):
    """A step it references is not complete in the bucket: the step is not committed
    there (the drain puts it back in the queue, its holders go first)."""


class Publisher:
    """Uploads steps of this node to ``remote``."""

    def __init__(
        self,
        remote: Remote,
        index: NodeIndex,
        store: LocalStore,
        io: IoPool,
        node_id: str,
        stall_seconds: float,
        on_stall: Callable[[Step, str], None],
        reading: Callable[[str], Set[tuple[int, int]]] = lambda job: frozenset(),
        holders_missing: Callable[[Step], str] = lambda st: "",
    ) -> None:
        self.remote = remote
        self.index = index
        self.store = store
        self.io = io
        self.node_id = node_id
        self.suspect: set[tuple[str, int]] = set()
        """Steps an earlier attempt may have left parts of in the bucket."""
        self.stall_seconds = stall_seconds
        self._on_stall = on_stall
        self._progress_at = 0.0
        self.reading = reading
        """``(step, timeline)`` of the holders a job's local steps read (the catalog's
        ``read_copies``): a replaced copy they read stays in the bucket, held."""
        self.holders_missing = holders_missing
        """Why a step may not be committed now: a step it references is not complete in
        the bucket (lifecycle/holders.py, from the drain)."""

    async def publish(
        self, st: Step, first: Callable[[], Awaitable[bool]] | None = None
    ) -> tuple[int, int] | None:
        """:meth:`_upload`, reporting in status (and as a RETRYING event) when it makes
        no progress for ``stall_seconds``: a store that hangs never raises. ``first``
        runs before it, watched the same way (it reads the bucket too); when it says
        False, ``st`` is not uploaded (None)."""
        self._progress_at = time.monotonic()
        task = asyncio.ensure_future(self._upload_unless(st, first))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.stall_seconds / 3)
                if done:
                    return task.result()
                idle = time.monotonic() - self._progress_at
                if idle >= self.stall_seconds:
                    self._on_stall(
                        st,
                        f"no progress uploading {st.job}/{st.step} to {self.remote.url} for "
                        f"{idle:.0f} s: the store is not answering (still waiting on it)",
                    )
                    self._progress_at = time.monotonic()  # report again after as long
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})  # its part uploads end before we go on

    async def _upload_unless(
        self, st: Step, first: Callable[[], Awaitable[bool]] | None
    ) -> tuple[int, int] | None:
        if first is not None and not await first():
            return None
        return await self._upload(st)

    async def local_changed(self, st: Step) -> str:
        """Why the step can never upload, if its local bytes no longer match the
        checksums recorded at commit; empty otherwise."""
        if st.manifest is None:
            return ""
        local_dir = self.store.step_dir(st.job, st.step)
        # Only the step's own files were uploaded: its references are its holders' to check.
        bad = await self.io.run(partial(verify_step, references=False), local_dir, st.manifest)
        if not bad:
            return ""
        if st.adopted:
            return (
                f"{len(bad)} adopted files changed after adoption (e.g. {bad[0]}): ckptd holds "
                "hard links to them, so a directory must not be modified once adopted; adopt "
                "the new version under a new step"
            )
        return (
            f"the local copy no longer matches the checksums recorded at commit ({bad[0]}"
            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}): it was set aside"
        )

    async def _retract_replaced(self, st: Step, adopted: bool) -> None:
        """A copy of this node in the bucket under ``st``'s number that is another save
        (an earlier timeline's, which ``st`` replaced) comes out first, marker first: no
        reader ever sees its marker beside ``st``'s objects (remote/retract.py). Its
        files stay, held, while this node's steps read them (held.py): the steps of that
        timeline kept in the bucket, or on their way there."""
        entries = await self.index.entries(st.job)
        old = entries.get(st.step)
        if old is None or (old.timeline == st.timeline and old.adopted == adopted):
            return
        log.info(
            "%s/%d: retracting this node's copy of timeline %d from %s before uploading the "
            "save of timeline %d that replaced it",
            st.job,
            st.step,
            old.timeline,
            self.remote.url,
            st.timeline,
        )
        read = held.read_in_bucket(entries) | self.reading(st.job)
        await held.take_out(self.remote, self.index, st.job, self.node_id, old, read)

    async def _publish_held(self, st: Step) -> None:
        """The held copies ``st`` reads that the bucket lacks go up first, from the local
        tier's (local/held.py); one missing there too is left to the check before the
        marker, which refuses the commit (``holders_missing``)."""
        in_bucket = await self.index.held(st.job)
        entries = await self.index.entries(st.job)
        for n, timeline in sorted(st.reads().items()):
            if (n, timeline) in in_bucket or (
                (e := entries.get(n)) is not None and e.timeline == timeline and not e.retracting
            ):
                continue
            if self.store.held.has(st.job, n, timeline):
                where = self.store.held.path(st.job, n, timeline)
                await held.publish(
                    self.remote, self.index, st.job, self.node_id, n, timeline, where
                )

    async def _upload(self, st: Step) -> tuple[int, int]:
        """Upload one step, its marker last; returns (files sent, files already there).
        In stages: what this save replaces goes (retract, held copies), the rank files,
        an adopted tree's own commit file, then this node's part: manifest, ranks,
        marker (the commit point), and the node index."""
        if faults.armed("drain.upload"):
            await asyncio.to_thread(faults.hit, "drain.upload")
        manifest = st.manifest
        assert manifest is not None
        adopted = manifest.adopted
        tree = step_prefix(st.job, st.step)
        records = record_prefix(st.job, st.step, adopted)
        # An adopted tree is published where its framework reads it (its own commit
        # file last); ckptd's records of the step are committed beside it.
        tree_commit = self.remote.tree_commit(tree, records, self.node_id) if adopted else None
        await self._retract_replaced(st, adopted)
        await self._publish_held(st)
        suspect = st.key in self.suspect
        sent, skipped = await self._send_files(st, manifest, tree_commit, suspect)
        if tree_commit is not None:
            await self._commit_tree(st, manifest, tree_commit)
        await self._commit_part(st, manifest, records)
        await self.index.add(st.job, _index_entry(st, manifest))
        if suspect:
            # Attempts cut by an outage or a kill could not abort their multipart
            # uploads: do it now (this node's prefix only: never another's in flight).
            with contextlib.suppress(Exception):
                data = data_prefix(
                    st.job, st.step, self.node_id, manifest.data_layout, manifest.timeline
                )
                await self.remote.cleanup_incomplete(f"{tree}/" if adopted else f"{data}/")
            self.suspect.discard(st.key)
        return sent, skipped

    async def _send_files(
        self, st: Step, manifest: Manifest, tree_commit: Commit | None, suspect: bool
    ) -> tuple[int, int]:
        """Every rank file but an adopted tree's commit file, in waves (upload_order);
        after an attempt that may have sent some (``suspect``), those already there
        with the right crc32c are not sent again. (sent, skipped)."""
        local_dir = self.store.step_dir(st.job, st.step)
        skipped: list[str] = []

        async def one(rank_file: str, size: int, crc32c: int) -> None:
            if tree_commit is not None:
                key = f"{tree_commit.location}/{tree_path(rank_file)}"
            else:
                key = file_key(
                    st.job,
                    st.step,
                    self.node_id,
                    rank_file,
                    False,
                    manifest.data_layout,
                    manifest.timeline,
                )
            with contextlib.suppress(FileNotFoundError):
                if suspect and await self.remote.native_crc32c(key) == crc32c:
                    log.info(
                        "%s is already in the bucket with the right crc32c: not sent again", key
                    )
                    skipped.append(rank_file)
                    return
            if faults.armed("drain.file"):
                await asyncio.to_thread(faults.hit, "drain.file")
            await self.remote.put_file(local_dir / rank_file, key, size, crc32c)
            self._progress_at = time.monotonic()

        by_file = {r.file: r for r in manifest.ranks}
        top_commit = f"{FILES_DIR}/{COMMIT_FILE}"
        for wave in upload_order([f for f in by_file if f != top_commit]):
            await gather_all(*(one(f, by_file[f].size, by_file[f].crc32c) for f in wave))
        return len(by_file) - len(skipped), len(skipped)

    async def _commit_tree(self, st: Step, manifest: Manifest, tree_commit: Commit) -> None:
        """An adopted tree's own commit file last (read back against its crc32c)."""
        await asyncio.to_thread(faults.hit, "drain.before_tree_commit")
        by_file = {r.file: r for r in manifest.ranks}
        top_commit = f"{FILES_DIR}/{COMMIT_FILE}"
        marker = None
        if top_commit in by_file:
            local_dir = self.store.step_dir(st.job, st.step)
            marker = await self.io.run((local_dir / top_commit).read_bytes)
            want = by_file[top_commit].crc32c
            if checksum.value(marker) != want:
                raise self.remote.mismatch(top_commit, "read back", checksum.value(marker), want)
        await tree_commit.finalize(marker)

    async def _commit_part(self, st: Step, manifest: Manifest, records: str) -> None:
        """This node's part of the step: its manifest and ranks, then its marker (the
        commit point), once every step it references is in the bucket and the manifest
        read back is the one sent."""
        node, adopted = self.node_id, manifest.adopted
        part = MarkerCommit(
            self.remote, f"{records}/{node}", marker_key(st.job, st.step, node, adopted)
        )
        local_dir = self.store.step_dir(st.job, st.step)
        manifest_bytes = await self.io.run((local_dir / "manifest.json").read_bytes)
        mkey = manifest_key(st.job, st.step, node, adopted)
        await self.remote.put_bytes(mkey, manifest_bytes)
        if not adopted and manifest.ranks:
            ranks = (r.rank for r in manifest.ranks)
            await self.remote.put_bytes(ranks_key(st.job, st.step, node, ranks), b"")
        await asyncio.to_thread(faults.hit, "drain.before_marker")
        # The commit point: a step whose holders are not all in the bucket must not be
        # listed there (the evictor may have taken one out while this one went up).
        missing = self.holders_missing(st)
        if missing:
            raise HolderMissing(missing)
        # An upload of an earlier save under this number, cut when this one replaced it,
        # may land its manifest late: the marker commits this save's (readers check the
        # marker's timeline against the manifest too, remote/read.py).
        if await self.remote.get_bytes(mkey) != manifest_bytes:
            raise RemoteError(f"{mkey}: a late write replaced the manifest just sent", True)
        await part.finalize(json.dumps(_marker_info(st, manifest, node)).encode())


def _marker_info(st: Step, manifest: Manifest, node: str) -> dict[str, Any]:
    """What a node's marker of a step records (remote/layout.py)."""
    return {
        "node": node,
        "job": st.job,
        "step": st.step,
        "time": time.time(),
        "files": [r.file for r in manifest.ranks] + ["manifest.json"],
        # What retention needs once the local copy is gone.
        "created_unix": manifest.created_unix,
        "milestone": st.milestone,
        "metrics": st.metrics,
        # Which timeline it is of: a node that lost its disk learns the lineage.
        "timeline": manifest.timeline,
        "forks": manifest.forks,
        # The steps its references read: retention keeps them while it is here.
        "holders": sorted(manifest.holders()),
        # Where its rank files are: deleted by their layout's prefix (retract.py).
        "data_layout": manifest.data_layout,
    }


def _index_entry(st: Step, manifest: Manifest) -> Entry:
    """The node index's entry of a step just committed in the bucket."""
    return Entry(
        st.step,
        manifest.adopted,
        manifest.created_unix,
        st.milestone,
        dict(st.metrics),
        st.pinned,
        manifest.timeline,
        manifest.forks,
        sorted(manifest.holders()),
        manifest.data_layout,
    )
