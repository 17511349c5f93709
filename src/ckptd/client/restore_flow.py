"""Client-side restore: ask the daemon for a step, build the tree over verified memory.

:meth:`ckptd.client.Client.restore` is the entry point; the arrays are built by
:mod:`.mapped_views`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ckptd.core.errors import CheckpointCorrupt, CheckpointNotFound, CkptdError
from ckptd.core.session import open_readable
from ckptd.core.shard_table import table_of
from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from . import mapped_views, rank_files
from .leaves.jax_arrays import build_leaf
from .shards import CorruptShard, MissingShards, ShardReader

log = logging.getLogger("ckptd.client")


def _data_len(manifest: dict[str, Any], rank: int) -> int:
    """The bytes of ``rank``'s shards in a step: what its save's lease held."""
    return int(table_of(manifest).of_rank(rank).length.sum())


def restore(
    conn: Connection,
    job: str,
    rank: int,
    step: int | None,
    target: Any,
    shared_memory: bool,
    metadata: tuple[tuple[str, str], ...] = (),
    healthy: bool = False,
    restored: Callable[[Callable[[], int]], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """See :meth:`ckptd.client.Client.restore` (``metadata``: the liveness header;
    ``restored``: once the rank is restored, given its data length in bytes, as a
    function: the manifest's table is read again only if it is called)."""

    def opener(path: str) -> int:
        return open_readable(conn.session, path)

    for attempt in range(8):
        req = pb.RestoreRequest(
            job=job, rank=rank, shared_memory=shared_memory, healthy=healthy, copy_on_write=True
        )
        if step is not None:
            req.step = int(step)
        try:
            resp = conn.restore(req, None, metadata)
        except CheckpointNotFound as exc:
            if attempt:
                raise CheckpointCorrupt(
                    f"{exc} (a newer copy failed its checksum and was set aside)", "DATA_LOSS"
                ) from None
            raise
        manifest = json.loads(resp.manifest_json)
        holders = dict(resp.holder_directories)
        reader = ShardReader(resp.directory, manifest, opener, holders)
        leaf_builder = jax_leaf_builder(conn, job, reader, resp)

        def adopt(arrays: dict[str, np.ndarray], rd: ShardReader = reader) -> None:
            rd.adopt(rank, arrays)

        try:
            if resp.HasField("lease"):
                out = adopt_segment(conn, rank, resp, manifest, leaf_builder, target, adopt)
            else:
                mm = mapped_views.map_file_verified(
                    resp.directory, manifest, rank, opener, holders=holders
                )
                out = mapped_views.build_tree(mm, manifest, rank, 0, leaf_builder, target, adopt)
            if restored is not None:
                restored(partial(_data_len, manifest, rank))
            return out
        except rank_files.Gone as gone:  # evicted between the answer and the open
            log.info("step %d of job %s: %s", resp.step, job, gone)
            if attempt == 7:
                raise
            continue
        except (mapped_views.Corrupt, CorruptShard) as bad:
            log.error("step %d of job %s: %s; asking for another copy", resp.step, job, str(bad))
            # The client checks only rank files of the local tier (its own, or other ranks'
            # shards); a segment it was handed was checked by the daemon before it was sent.
            report = pb.ReportCorruptRequest(
                job=job, step=resp.step, tier=pb.TIER_LOCAL, detail=str(bad)
            )
            conn.report_corrupt(report)
            continue
        finally:
            reader.close()
    raise CheckpointCorrupt(
        f"every copy the daemon offered for job {job!r} was corrupt", "DATA_LOSS"
    )


def jax_leaf_builder(
    conn: Connection, job: str, reader: ShardReader, resp: pb.RestoreResponse
) -> Callable[[dict[str, Any], Any], Any]:
    """Builds saved jax leaves; fetches other nodes' parts the first time a
    target needs shards this node did not save."""
    fetched = False

    def build(spec: dict[str, Any], target: Any) -> Any:
        nonlocal fetched
        try:
            return build_leaf(reader, spec, target)
        except MissingShards:
            if fetched:
                raise
        fetched = True
        peers = conn.fetch_peers(pb.FetchPeersRequest(job=job, step=resp.step))
        for part in peers.parts:
            reader.add_part(part.directory, json.loads(part.manifest_json), part=True)
        return build_leaf(reader, spec, target)

    return build


def adopt_segment(
    conn: Connection,
    rank: int,
    resp: pb.RestoreResponse,
    manifest: dict[str, Any],
    jax_leaf: Callable[[dict[str, Any], Any], Any],
    target: Any,
    adopt: Callable[[dict[str, np.ndarray]], None],
) -> tuple[Any, dict[str, Any]]:
    """Map and lock the verified segment, then tell the daemon we hold it."""
    try:
        fd = conn.session.open_lease(resp.lease.lease_id)
        # The memory tier keeps its segment for the next restart: map it copy-on-write.
        private = resp.tier == pb.TIER_MEMORY
        mm = mapped_views.map_segment_locked(fd, resp.lease.size_bytes, private)
    except (OSError, CkptdError):
        conn.release_lease(pb.ReleaseLeaseRequest(lease_id=resp.lease.lease_id))
        raise
    try:
        held = pb.ReleaseLeaseRequest(lease_id=resp.lease.lease_id, client_holds=True)
        conn.release_lease(held)
    except BaseException:
        mm.close()
        raise
    return mapped_views.build_tree(
        mm, manifest, rank, resp.data_offset_in_file, jax_leaf, target, adopt
    )
