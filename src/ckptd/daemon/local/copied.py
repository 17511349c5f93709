"""Commit while copying: the client's word that its lease is whole.

A client may send ``CommitShards`` while it still copies the save into the lease,
so the commit's round trip and the journal's fsync overlap the copy instead of
following it. Once every byte is in place the client writes the request's
``copied_nonce`` into the lease at ``copied_at`` (past the data); if its copy
failed, the nonce's complement. ``save()`` returns only once it has both the
daemon's answer and its own word written, so:

- the daemon journals and answers as usual, and the rank's write waits for the
  word before it reads a byte (:func:`wait`);
- a client that exits before writing it never returned from that save: the
  save fails and its memory comes back;
- a replay after a daemon crash waits the same way, for the client named in the
  journaled record (``copied_holder``, set by the daemon, never by the client).

The nonce is random per commit: whatever a reused segment held at that offset
before cannot pass for it. Whether the client lives is asked of its process (the
pid and start time its session's credentials gave), or, where the daemon cannot
see it (another pid namespace), of its liveness file (liveness.py): a live client
is waited for however slow its copy is (a device-to-host copy of a large state),
also by a daemon that is stopping (a client that hangs holds the stop up until
it is killed; the journal then replays the save, still waiting for the word).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ckptd.core.errors import CkptdError, InvalidArgument
from ckptd.core.format import COPIED_FAILED as FAILED
from ckptd.core.format import COPIED_WORD as WORD

from .. import faults
from .lease import Lease
from .liveness import locked_by_others, process_running
from .pending import CommitRequest


class Incomplete(CkptdError):
    """The client's copy never completed: it failed, or the client exited first. The
    save fails; this is the trainer's everyday failure, not the daemon's."""


FIRST_POLL = 0.0002
LAST_POLL = 0.005
"""Seconds between looks at the word: from the first to the last, doubling. A small
save's copy is done about when its commit is journaled; a large one's takes long
enough that a look every few ms costs nothing and delays LOCAL by that little."""


def check(copied_at: int, data_end: int, lease: Lease, holder: str) -> None:
    """Where the word lies must be in the lease, past the data; and someone must be
    known to be copying (their liveness file), or the word could be waited for forever."""
    if copied_at % WORD or copied_at < data_end or copied_at + WORD > lease.segment.size:
        raise InvalidArgument(
            f"copied_at {copied_at} must be a multiple of {WORD} from byte {data_end} (the "
            f"end of the data) within the lease's {lease.segment.size} bytes; acquire a "
            "lease with room for the word"
        )
    if not holder:
        raise InvalidArgument(
            "a commit sent while copying needs the lease to have been asked for with the "
            "client's liveness header (ckptd-holder); commit once the copy is done instead"
        )


def alive(req: CommitRequest, shm_dir: Path) -> bool:
    """Whether the client copying for ``req`` still lives: its process, where the
    daemon saw it (a pid and start time no later process has), else its liveness file
    (which a process it forked, or another user, may also hold locked)."""
    pid, started = req.copied_process
    if pid > 0 and started > 0:
        return process_running(pid, started)
    return locked_by_others(shm_dir / req.copied_holder)


async def wait(lease: Lease, req: CommitRequest, shm_dir: Path) -> None:
    """Return once the client wrote ``req``'s nonce at ``copied_at``; raise
    :class:`Incomplete` if its copy failed or it exited first (that save never returned)."""
    if faults.armed("copied.wait"):  # tests stop the daemon here: answered, not yet read
        await asyncio.to_thread(faults.hit, "copied.wait")
    word, nonce = lease.segment.view(req.copied_at, WORD), req.copied_nonce
    pause = FIRST_POLL
    while True:
        value = int.from_bytes(word, "little")
        if value == nonce:
            return
        if value == nonce ^ FAILED:
            raise Incomplete("the client's copy into shared memory failed; save() raised")
        if not alive(req, shm_dir):
            # The word may have landed just before the client exited: look once more.
            if int.from_bytes(word, "little") == nonce:
                return
            raise Incomplete(
                "the client exited before its copy into shared memory was complete (its "
                "save() never returned); nothing of it was kept"
            )
        await asyncio.sleep(pause)
        pause = min(2 * pause, LAST_POLL)
