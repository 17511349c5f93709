"""The node-loss rate's record: this node name's claim and a sample of the fleet's.

A node's own daemon cannot count its node's losses (its record is on the disk
that is lost), but each node name's claim in the bucket keeps how long the name
has been claimed and how often a new disk took it over (claim.py). Summed over
this node's claim and a random sample of at most :data:`SAMPLE` other names'
(``_nodes/`` listed once, the sampled claims read), they give the node-loss
rate ``Goodput()`` learns: ``observed_seconds`` (now minus each name's first
claim, summed) and ``replacements`` (summed). The sample is taken in the
background (the first within :data:`START_JITTER_SECONDS` of the start, at random),
then at most every :data:`REFRESH_SECONDS`, never before serving; a failure
is logged at debug level and the sample is taken again later (it only tunes a
save interval). Its cost: one delimited LIST of ``_nodes/`` (a page per 1,000
names) and :data:`SAMPLE` GETs per daemon and refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from .. import faults
from .base import Remote
from .claim import CLAIM_DIR, ClaimRecord, NodeClaim, claim_key
from .records import valid_names

log = logging.getLogger("ckptd.claim")

SAMPLE = 16
"""Other node names' claims read per refresh, chosen at random."""
REFRESH_SECONDS = 3600.0
"""Seconds between two samples of the fleet."""
RETRY_SECONDS = 300.0
"""Seconds before a failed sample is taken again."""
START_JITTER_SECONDS = 300.0
"""The first sample waits a random time up to this: a fleet restarted at once does not
list ``_nodes/`` all in the same second."""
TIMEOUT_SECONDS = 60.0
"""Longest a sample may take (a store that hangs must not hold up the daemon's stop)."""
FAILPOINT = "fleet.sampled"
"""Armed (tests): the first sample is taken at once, and each one reaches this point."""


class NodeFleet:
    """This node's claim plus a sample of the other names' claims (see the module)."""

    def __init__(
        self,
        remote: Remote,
        claim: NodeClaim,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.remote = remote
        self.claim = claim
        self.clock = clock
        self._rng = rng or random.Random()
        self.others: list[ClaimRecord] = []
        """The sampled claims of other node names (empty before the first sample)."""
        self._stop = asyncio.Event()

    def totals(self) -> tuple[float, int, int]:
        """``(observed_seconds, replacements, names)`` over this node's claim (while
        this daemon holds it) and the sampled ones; ``(0.0, 0, 0)`` with neither."""
        now = self.clock()
        records = [*([self.claim.mine] if self.claim.held else []), *self.others]
        observed = sum(max(now - r.since_unix, 0.0) for r in records)
        return observed, sum(r.replacements for r in records), len(records)

    async def sample(self) -> None:
        """List the node names once and read up to :data:`SAMPLE` others' claims; a
        name or a record that is not ckptd's is skipped and logged once
        (:meth:`ClaimRecord.parse`), so every value summed is bounded."""
        mine = self.claim.mine.node
        names = [d.rstrip("/").rsplit("/", 1)[-1] for d in await self.remote.list_dirs(CLAIM_DIR)]
        others = [n for n in names if n != mine and valid_names(f"{CLAIM_DIR}/{n}", node=n)]
        chosen = self._rng.sample(others, min(SAMPLE, len(others)))
        found = await asyncio.gather(*(self.remote.read_versioned(claim_key(n)) for n in chosen))
        parsed = [
            ClaimRecord.parse(got[0], n)
            for n, got in zip(chosen, found, strict=True)
            if got is not None
        ]
        self.others = [r for r in parsed if r is not None]

    async def run(self) -> None:
        """Sample soon and then every :data:`REFRESH_SECONDS` (supervised: never raises
        for a store that fails; it retries after :data:`RETRY_SECONDS`)."""
        armed = faults.armed(FAILPOINT)
        jitter = 0.0 if armed else self._rng.uniform(0, START_JITTER_SECONDS)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), jitter)
        while not self._stop.is_set():
            wait = REFRESH_SECONDS
            try:
                await asyncio.wait_for(self.sample(), TIMEOUT_SECONDS)
            except Exception as exc:  # only an interval's tuning: later will do
                log.debug("sampling the node names' claims in %s: %s", self.remote.url, exc)
                wait = RETRY_SECONDS
            if armed:  # tests learn the sample was taken (and its failure logged)
                await asyncio.to_thread(faults.hit, FAILPOINT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()


__all__ = ["REFRESH_SECONDS", "SAMPLE", "NodeFleet"]
