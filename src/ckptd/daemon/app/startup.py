"""The daemon's start-up steps that can refuse: recovering the local tier and
replaying the journal, opening and checking the remote tier.

Each failure is one :class:`StartupError` that says what to fix, never a traceback
or a stack of retries; the composition root (compose.py) runs them in order.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ckptd.core.errors import FailedPrecondition
from ckptd.core.redact import redact
from ckptd.proto import ckptd_pb2 as pb

from ..api.access import Access
from ..api.requests import parse_commit
from ..catalog import Catalog
from ..io import IoPool
from ..lifecycle.pins import load_pins
from ..local.journal import Journal
from ..local.memory import MemoryTier
from ..local.pending import CommitRequest
from ..local.saver import Saver
from ..local.staging import Staging
from ..local.store import LocalStore
from ..remote.backends import open_remote
from ..remote.base import Remote
from ..remote.options import RemoteOptions

log = logging.getLogger("ckptd.server")

REMOTE_CHECK_SECONDS = 30.0
"""How long the remote tier's start-up check waits for an answer."""


class StartupError(FailedPrecondition):
    """The daemon cannot start; the message says why and what to do."""


async def recover(
    root: Path,
    catalog: Catalog,
    store: LocalStore,
    staging: Staging,
    journal: Journal,
    saver: Saver,
    access: Access,
    io: IoPool,
    memory: MemoryTier,
) -> None:
    """Rebuild the catalog from the local tier, then finish the acknowledged handoffs
    the last daemon had not made LOCAL, before any client can ask about them."""
    recovery = await io.run(store.recover)
    await io.run(access.load)
    try:
        handoffs = await io.run(journal.load, parse_record)
    except OSError as exc:
        raise StartupError(f"cannot open the journal {journal.path}: {exc}") from None
    pins = await io.run(load_pins, root)
    try:  # the daemon's own segment directory, before the replay looks into it
        await io.run(staging.open)
    except OSError as exc:
        raise StartupError(
            f"cannot make a directory for shared memory in {staging.shm_dir}: {exc}"
        ) from None
    for m in recovery.manifests:
        catalog.recovered(m, pinned=(m.job, m.step) in pins)
    replayed = await saver.replay(handoffs, parse_record)
    if handoffs:
        log.warning(
            "journal: %d acknowledged handoffs were not LOCAL at the last exit; "
            "%d are being written now",
            len(handoffs),
            replayed,
        )
    kept = memory.adopt_leftovers()  # a crashed daemon's memory tier, before the sweep
    if kept:
        log.info("memory tier: took back %d rank files a crashed daemon kept", kept)
    removed_segments = staging.remove_leftovers()
    for line in recovery.skipped:
        log.warning("ignoring step directory that is not a ckptd commit: %s", line)
    log.info(
        "recovered %d committed steps; removed %d staging leftovers and %d stale segments",
        len(recovery.manifests),
        recovery.removed_staging,
        removed_segments,
    )


def open_remote_tier(options: RemoteOptions) -> Remote | None:
    """The remote tier's backend (checked by :func:`check_remote`), or None without one."""
    if not options.remote:
        return None
    try:
        return open_remote(
            options.remote,
            options.remote_endpoint_url,
            options.part_size_bytes,
            options.drain_concurrency,
        )
    except Exception as exc:
        raise remote_error(options.remote, exc) from None


async def check_remote(remote: Remote | None, url: str) -> None:
    """Check the remote tier: one clear error at start-up, not a stack of retries."""
    if remote is None:
        log.warning(
            "no remote tier configured: checkpoints live only on this node's disk "
            'and die with it (set remote = "s3://..." or "gs://...")'
        )
        return
    try:
        await asyncio.wait_for(remote.check(), REMOTE_CHECK_SECONDS)
    except Exception as exc:
        raise remote_error(url, exc) from None


def remote_error(url: str, exc: BaseException) -> StartupError:
    """The start-up error for a remote tier at ``url`` that failed with ``exc``
    (credentials in the URL or the message redacted)."""
    if isinstance(exc, TimeoutError):
        reason = "no answer within the time allowed (check the endpoint and the network)"
    else:
        reason = str(exc) or type(exc).__name__
    return StartupError(redact(f"cannot use remote {url}: {reason}"))


def parse_record(body: bytes) -> CommitRequest:
    """A journaled ``CommitShards`` request, validated again as if it had just arrived."""
    return parse_commit(pb.CommitShardsRequest.FromString(body))
