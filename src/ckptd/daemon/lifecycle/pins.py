"""Pins: a pinned step is never evicted from any tier.

A pin is kept in two places so it outlives both the daemon and the node:
``<root>/.pins.json`` (read at start-up) and a ``_pinned`` object beside the
step's records in the bucket (looked for before the step leaves the bucket), also
noted in the node's index there (index.py: what a node that lost its disk reads).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ckptd.core.errors import CkptdError, CkptdUnavailable, FailedPrecondition, from_os_error

from ..catalog.roles import Pinning
from ..files import replace_synced
from ..io import IoPool
from ..remote.base import Remote
from ..remote.index import NodeIndex
from ..remote.layout import pin_key

log = logging.getLogger("ckptd.pins")

PINS_FILE = ".pins.json"


def load_pins(root: Path) -> set[tuple[str, int]]:
    """The pins persisted under ``root`` (blocking; start-up). Unreadable: none, logged."""
    path = root / PINS_FILE
    try:
        raw = json.loads(path.read_text())
        return {(str(job), int(step)) for job, steps in raw.items() for step in steps}
    except FileNotFoundError:
        return set()
    except (ValueError, TypeError, AttributeError) as exc:
        log.error("ignoring unreadable %s: %s", path, exc)
        return set()


class Pins:
    """Pin and unpin steps: the bucket's pin object, the local file, the catalog."""

    def __init__(
        self,
        catalog: Pinning,
        root: Path,
        io: IoPool,
        remote: Remote | None,
        index: NodeIndex | None,
    ) -> None:
        self.catalog = catalog
        self.path = root / PINS_FILE
        self.io = io
        self.remote = remote
        self.index = index

    async def set(self, job: str, step: int, pinned: bool) -> None:
        """Pin (or unpin) a step that has a complete copy in some tier."""
        st = self.catalog.require(job, step)
        self.catalog.check_pinnable(st)
        if self.remote is not None:
            try:
                await self._record_in_bucket(self.remote, job, step, pinned, st.adopted)
            except CkptdError:
                raise
            except Exception as exc:  # the pin is refused whole: the bucket must keep it too
                what = "pin" if pinned else "unpin"
                if not self.remote.is_transient(exc):
                    raise FailedPrecondition(
                        f"cannot record the {what} of {job}/{step} in {self.remote.url}: "
                        f"{exc}; nothing changed here (see the daemon log for the bucket's "
                        "settings)"
                    ) from None
                raise CkptdUnavailable(
                    f"cannot record the {what} of {job}/{step} in {self.remote.url}: the "
                    f"bucket does not answer ({type(exc).__name__}); nothing changed here, "
                    f"{what} again once it is back"
                ) from None
        try:
            await self._save(changed=(job, step, pinned))
        except OSError as exc:  # a full disk, mostly: the catalog keeps the old pin
            raise from_os_error(
                exc, f"cannot record the pin of {job}/{step} in {self.path}"
            ) from None
        self.catalog.set_pinned(st, pinned)
        log.info("%s/%d %s", job, step, "pinned" if pinned else "unpinned")

    async def _record_in_bucket(
        self, remote: Remote, job: str, step: int, pinned: bool, adopted: bool
    ) -> None:
        """The pin object beside the step's records, and the node index's note of it."""
        key = pin_key(job, step, adopted)
        if pinned:
            await remote.put_bytes(key, b"pinned by ckptd pin\n")
        else:
            await remote.delete([key])
        if self.index is not None:  # a node restoring from the bucket learns it there
            await self.index.set_pinned(job, step, pinned)

    async def _save(self, changed: tuple[str, int, bool]) -> None:
        """Persist every pin, with ``changed`` (job, step, pinned) applied (atomically:
        temp file, fsync, rename), before the catalog shows it."""
        pins: dict[str, list[int]] = {}
        for st in self.catalog.steps():
            if (st.job, st.step) == changed[:2] and not changed[2]:
                continue
            if st.pinned or (st.job, st.step) == changed[:2]:
                pins.setdefault(st.job, []).append(st.step)
        data = json.dumps({j: sorted(s) for j, s in sorted(pins.items())}).encode()
        await self.io.run(replace_synced, self.path, data)
