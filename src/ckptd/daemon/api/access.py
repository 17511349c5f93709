"""Who may do what: jobs belong to a uid, memory to a process, paths to their readers.

- **Jobs.** A job belongs to the uid whose call on it first succeeded (a lease
  granted, a step adopted, a directory watched, a pin set); the owner is recorded
  in ``<root>/.owners/<job>`` (owners.py) when that call succeeds, so a refused
  call claims nothing, and a lease is granted before the first byte of the job is
  written, so the record survives restarts. While the first call runs, the job is
  reserved for its uid in memory. A root written before owners were recorded gets
  its records from its files at start-up (owners.py), never opening a job to all. Another
  uid is refused with PERMISSION_DENIED unless the operator allows it: uids in
  ``allow_uids`` and members of a group in ``allow_gids`` may use every job;
  jobs matching a pattern in ``shared_jobs`` may be used by anyone who reaches
  the socket. The daemon's own uid and root are operators and may use every job.
- **Memory.** A lease is bound to the process it was granted to (uid and pid of
  its session); its segment is 0600 and only that process gets a descriptor of
  it (:meth:`Access.open_lease`). Free segments are reused only for the uid
  that used them before (staging.py), so a process that kept a mapping can never
  write into another user's lease.
- **Restore files.** A session may open, read-only, the files under directories
  the daemon handed it in a Restore or FetchPeers answer (:meth:`Access.grant`).
- **Paths.** Adopt, Watch and EnsureLocal act only inside ``adopt_dirs`` (and the
  job's own watched directory under the root), on resolved paths, and only where
  the calling process could read (adopt) or write (watch, put back) itself
  (:func:`ckptd.daemon.adopt.paths.check_access`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptd.core.errors import NotFound, PermissionDenied

from ..adopt.paths import Caller
from ..files import write_synced
from ..local.staging import Staging
from . import owners as records
from .liveness import LiveJobs
from .options import Sharing
from .owners import OWNERS_DIR, UNASSIGNED
from .sessions import Peer

log = logging.getLogger("ckptd.access")

MAX_GRANTS = 256
"""Restore directories remembered per session (the newest)."""


class Access:
    """The daemon's access decisions; methods run on the event loop."""

    def __init__(
        self,
        root: Path,
        staging: Staging,
        sharing: Sharing | None = None,
        owners: dict[str, int] | None = None,
    ) -> None:
        self.root = root
        self.staging = staging
        self.operators = frozenset({0, os.geteuid()})
        sharing = Sharing() if sharing is None else sharing  # None: the owner only
        self.allow_uids = frozenset(sharing.allow_uids)
        self.allow_gids = frozenset(sharing.allow_gids)
        self.shared_jobs = sharing.shared_jobs
        self.owners: dict[str, int] = {} if owners is None else owners
        """Each job's owner uid. Filled in place (never replaced): the composition root
        hands the same table to staging, which reuses a job's segments only for it."""
        self._claims: dict[str, int] = {}
        """Jobs reserved for the uid of calls still running: how many such calls."""
        self._grants: dict[str, OrderedDict[Path, None]] = {}
        self._dir = root / OWNERS_DIR
        self.live = LiveJobs()
        """Jobs a live process is saving (calls that claim a job are save calls)."""

    def load(self) -> None:
        """Read the recorded owners (start-up); a root without records gets them from
        its files first (owners.py)."""
        if not self._dir.is_dir():
            records.write_all(self._dir, records.infer(self.root, self.operators))
        self.owners.update(records.read_records(self._dir))

    # -- jobs ----------------------------------------------------------------
    def owner_of(self, job: str) -> int | None:
        """The uid owning ``job``, if any (staging reuses a job's segments only for it)."""
        return self.owners.get(job)

    def caller(self, peer: Peer) -> Caller:
        """``peer`` as adoption's path checks see it."""
        return Caller(peer.uid, peer.groups, self.privileged(peer))

    def privileged(self, peer: Peer) -> bool:
        """Operators: root and the daemon's own uid."""
        return peer.uid in self.operators

    def may_use(self, peer: Peer, job: str) -> bool:
        """Whether ``peer`` may act on ``job`` (without claiming it)."""
        owner = self.owners.get(job)
        return (
            owner is None
            or owner == peer.uid
            or self.privileged(peer)
            or peer.uid in self.allow_uids
            or bool(peer.groups & self.allow_gids)
            or any(fnmatch.fnmatchcase(job, p) for p in self.shared_jobs)
        )

    def check_job(self, peer: Peer, job: str) -> None:
        """Refuse ``peer`` on another uid's job (or one no owner was assigned yet)."""
        if self.may_use(peer, job):
            return
        if self.owners[job] == UNASSIGNED:
            self._reread(job)  # `ckptd own` may have assigned it since
            if self.may_use(peer, job):
                return
        if self.owners[job] == UNASSIGNED:
            raise PermissionDenied(
                f"job {job!r} was saved before this ckptd recorded job owners, and its "
                f"files do not tell whose it is; ask the operator to run `ckptd own {job} "
                "<your user>`, or use another job name"
            )
        raise PermissionDenied(
            f"job {job!r} belongs to uid {self.owners[job]}, and this process runs as "
            f"uid {peer.uid}; use your own job name, or ask the operator to add your "
            "uid to allow_uids (or the job to shared_jobs) in the ckptd config"
        )

    @contextlib.contextmanager
    def claiming(self, peer: Peer, job: str) -> Iterator[None]:
        """Check ``peer`` on ``job`` and, if the job has no owner, make ``peer``'s uid
        its owner once the body succeeds (recorded on disk then). Meanwhile the job
        is reserved for that uid: other uids are refused, and if every call that
        reserved it fails, nobody owns it (operators never claim: their jobs stay
        open to the uid that saves them)."""
        if job not in self.owners and not self.privileged(peer):
            self._reread(job)  # once per job: assigned by `ckptd own` while we ran?
        self.check_job(peer, job)
        self.live.saving(peer.token, job, peer.uid)
        if job in self._claims:  # reserved: its uid's calls join, others just use it
            reserving = self.owners[job] == peer.uid
        else:
            reserving = job not in self.owners and not self.privileged(peer)
        if not reserving:
            yield
            return
        self.owners[job] = peer.uid
        self._claims[job] = self._claims.get(job, 0) + 1
        try:
            yield
        except BaseException:
            left = self._claims.get(job)
            if left is not None:  # no call of it succeeded yet
                if left > 1:
                    self._claims[job] = left - 1
                else:
                    del self._claims[job], self.owners[job]
            raise
        if self._claims.pop(job, None) is not None:  # the first to succeed records it
            try:
                write_synced(self._dir / job, str(peer.uid).encode(), 0o640)
            except FileExistsError:  # `ckptd own` assigned it meanwhile: its record stands
                self._reread(job)
                return
            log.info("job %r belongs to uid %d from now on", job, peer.uid)

    def found_in_bucket(self, job: str, owner: int | None, known: bool) -> None:
        """The owner this node's index in the bucket records for ``job`` (remote/index.py):
        see :meth:`found_elsewhere`."""
        self.found_elsewhere(job, owner, known, "the bucket")

    def found_on_peer(self, job: str, owner: int | None, known: bool) -> None:
        """The owner a peer's replica of this node's ``job`` came with (peer/source.py):
        see :meth:`found_elsewhere`."""
        self.found_elsewhere(job, owner, known, "a peer")

    def found_elsewhere(self, job: str, owner: int | None, known: bool, where: str) -> None:
        """The owner a record ``where`` says ``job`` has on this node, taken where this
        root records none (a node that lost its disk takes its jobs back from the bucket
        or its peers, whichever comes first): the jobs come back with their owners, not
        open to the first caller. A record that does not say (``known`` False: written
        before owners were recorded) gives :data:`UNASSIGNED`, as a root without records
        does (owners.py); None recorded: an operator's job, open."""
        if job in self.owners or job in self._claims or (owner is None and known):
            return
        uid = owner if known and owner is not None else UNASSIGNED
        self.owners[job] = uid
        try:
            write_synced(self._dir / job, str(uid).encode(), 0o640)
        except FileExistsError:  # `ckptd own` assigned it meanwhile: its record stands
            self._reread(job)
            return
        except OSError as exc:  # kept in memory for this life; the record still says it
            log.warning("cannot record the owner of job %r in %s: %s", job, self._dir, exc)
        if uid == UNASSIGNED:
            log.warning(
                "job %r comes from %s, whose record does not say whose it is; it stays "
                "closed to non-operators until `ckptd own %s USER` assigns it",
                job,
                where,
                job,
            )
        else:
            log.info("job %r comes from %s; it belongs to uid %d there", job, where, uid)

    def _reread(self, job: str) -> None:
        """Pick up an owner record written while the daemon runs (``ckptd own``)."""
        if job in self._claims:
            return
        try:
            self.owners[job] = records.read_one(self._dir / job)
        except (OSError, ValueError):
            return

    # -- memory and files ------------------------------------------------------
    def open_lease(self, peer: Peer, request: dict[str, Any]) -> int:
        """A descriptor of a lease's segment, for the process it was granted to."""
        lease = self.staging.get(str(request.get("lease_id", "")))
        if lease.owner != peer.process:
            raise PermissionDenied(
                f"lease {lease.lease_id!r} was granted to another process; acquire your own"
            )
        # A segment the memory tier keeps is read-only to the client (it maps it
        # copy-on-write): nothing a restored trainer does reaches the kept copy.
        mode = os.O_RDONLY if lease.shared else os.O_RDWR
        return os.open(self.staging.path_of(lease.segment), mode | os.O_NOFOLLOW | os.O_CLOEXEC)

    def process_gone(self, process: tuple[int, int]) -> None:
        """A process's last session closed and it exited (or stayed away past
        lease_timeout_seconds, sessions.py): take back the leases it never committed; its
        uid's fair part of the staging budget is no longer kept on its account."""
        self.staging.process_gone(process)
        for lease_id in self.staging.owned_by(process):
            log.warning(
                "lease %s reclaimed: process %d (uid %d) that held it is gone",
                lease_id,
                process[1],
                process[0],
            )
            self.staging.release(lease_id)

    def grant(self, peer: Peer, directory: Path) -> None:
        """Let ``peer`` open the files under ``directory`` (a restore's answer)."""
        grants = self._grants.setdefault(peer.token, OrderedDict())
        grants[directory] = None
        grants.move_to_end(directory)
        while len(grants) > MAX_GRANTS:
            grants.popitem(last=False)

    def forget(self, token: str) -> None:
        """A session ended: drop its grants."""
        self._grants.pop(token, None)
        self.live.ended(token)

    def open_file(self, peer: Peer, request: dict[str, Any]) -> int:
        """A read-only descriptor of a file under a directory granted to ``peer``."""
        path = Path(os.path.normpath(str(request.get("path", ""))))
        granted: OrderedDict[Path, None] = self._grants.get(peer.token) or OrderedDict()
        if not any(path.is_relative_to(d) for d in granted):
            raise PermissionDenied(
                f"{path} is not part of a restore answered to this process; restore first"
            )
        # O_NOFOLLOW on the last component; the directories above are the daemon's own.
        real = Path(os.path.realpath(path.parent)) / path.name
        if not any(real.is_relative_to(os.path.realpath(d)) for d in granted):
            raise PermissionDenied(f"{path} leads outside the restore's directory")
        try:
            return os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"{path} no longer exists; restore again") from None
