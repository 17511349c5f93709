"""The local tier on NVMe: staging, atomic commit, start-up recovery.

Layout::

    <root>/<job>/<step>/manifest.json
    <root>/<job>/<step>/rank-00000.safetensors
    <root>/.staging/<job>.<step>.<token>/   in progress; deleted at start-up
    <root>/.cache/                         remote downloads in progress; deleted at start-up
    <root>/.corrupt/                       copies that failed a checksum; deleted at start-up

Commit point: the rename of the staging directory to ``<root>/<job>/<step>``.
Every file is fsynced before it, the parent directory after it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np

from ckptd.client.format import round_up

from . import crc, faults
from .errors import Conflict
from .manifest import Manifest

log = logging.getLogger("ckptd.localstore")

WRITE_CHUNK = 64 * 2**20
"""Bytes per write call: large enough for full NVMe queues, small enough to stay interruptible."""
MANIFEST = "manifest.json"
_COMBINE_ABOVE = 2**20  # shards at least this long are combined, not checksummed twice


def fsync_dir(path: Path) -> None:
    """fsync a directory so the entries in it (new files, renames) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: temp file, fsync, rename, fsync the dir."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def open_direct(path: Path, flags: int, mode: int = 0o640, want: bool = True) -> tuple[int, bool]:
    """Open with ``O_DIRECT`` when ``want`` and the filesystem allows it (tmpfs and some
    overlays refuse it with EINVAL: then a plain open); returns ``(fd, direct)``."""
    direct = getattr(os, "O_DIRECT", 0) if want else 0
    if direct:
        try:
            return os.open(path, flags | direct, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def crc32c_file_and_shards(
    header: bytes, data: memoryview, data_length: int, ranges: Sequence[tuple[int, int]]
) -> tuple[int, list[int]]:
    """crc32c of the whole file (header + data) and of each shard, from memory.

    The whole-file value is what object stores report natively (GCS crc32c, S3
    CRC32C), so the drain can verify an upload end to end without re-reading.
    """
    # One pass over the bytes: each shard's crc is folded into the file's with
    # crc.combine (a few hundred integer ops) instead of being read twice; small
    # shards and the alignment gaps are simply fed to the running value.
    flat = np.frombuffer(data, np.uint8)
    whole = google_crc32c.value(header)
    shard_crcs = [0] * len(ranges)
    pos = 0
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        offset, length = ranges[i]
        if offset > pos:
            whole = google_crc32c.extend(whole, flat[pos:offset])
        piece = flat[offset : offset + length]
        shard_crcs[i] = google_crc32c.extend(0, piece)
        if length >= _COMBINE_ABOVE:
            whole = crc.combine(whole, shard_crcs[i], length)
        else:
            whole = google_crc32c.extend(whole, piece)
        pos = max(pos, offset + length)
    if pos < data_length:
        whole = google_crc32c.extend(whole, flat[pos:data_length])
    return whole, shard_crcs


def crc32c_file(path: Path, chunk: int = 8 * 2**20) -> int:
    """crc32c of a whole file, read in chunks (buffered: small files of other tools)."""
    value = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while n := f.readinto(buf):
            value = google_crc32c.extend(value, np.frombuffer(buf, np.uint8, n))
    return int(value)


def crc32c_ranges(data: memoryview, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """crc32c of each ``(offset, length)`` slice of ``data``, without copying it."""
    # google-crc32c accepts numpy arrays but not writable memoryviews; this is a view, not a copy.
    flat = np.frombuffer(data, np.uint8)
    return [google_crc32c.extend(0, flat[offset : offset + length]) for offset, length in ranges]


def write_file_direct(
    path: Path, header: bytes, data: memoryview, data_length: int, spare: Path | None = None
) -> None:
    """Write ``header`` then the first ``data_length`` bytes of ``data``, fsync, close.

    ``header`` is a multiple of 4 KiB and ``data`` is page-aligned memory at
    least ``round_up(data_length)`` long, so the whole file goes out in aligned
    ``O_DIRECT`` writes (no page-cache allocation, which is slow on these VMs);
    the padding past the true end is truncated away. Falls back to buffered
    writes where the filesystem refuses O_DIRECT (tmpfs, some overlays).
    ``spare``: an old file to overwrite in place instead of creating one (its
    blocks are already allocated, which makes the write and fsync faster);
    every byte up to the new size is overwritten and the rest truncated.
    """
    if spare is not None:  # first: whatever fails next, the staging dir's cleanup has it
        os.rename(spare, path)
    faults.hit("write.begin")
    padded = round_up(data_length)
    if len(data) < padded:
        raise ValueError("lease view shorter than the padded data section")
    if spare is not None:
        fd, direct = open_direct(path, os.O_WRONLY)
    else:
        fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if direct:
            try:
                _write_all(fd, header, data, padded, aligned=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC, 0o640)
                _write_all(fd, header, data, data_length, aligned=False)
        else:
            _write_all(fd, header, data, data_length, aligned=False)
        os.ftruncate(fd, len(header) + data_length)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, header: bytes, data: memoryview, length: int, aligned: bool) -> None:
    if aligned:
        # O_DIRECT needs an aligned source buffer; anonymous mmaps are page-aligned.
        with mmap.mmap(-1, len(header)) as buf:
            buf.write(header)
            _pwrite_all(fd, memoryview(buf), 0)
    else:
        _pwrite_all(fd, memoryview(header), 0)
    pos = 0
    while pos < length:
        n = min(WRITE_CHUNK, length - pos)
        _pwrite_all(fd, data[pos : pos + n], len(header) + pos)
        pos += n
        if pos < length:
            faults.hit("write.mid")


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf = buf[n:]
        offset += n


def read_data_direct(path: Path, offset: int, length: int, dest: memoryview) -> None:
    """Read ``length`` bytes at ``offset`` (a multiple of 4 KiB) into page-aligned ``dest``.

    The mirror of :func:`write_file_direct`: large aligned ``O_DIRECT`` reads into
    memory that is already faulted in, so no page cache is allocated. Raises
    ``ValueError`` if the file is shorter than expected.
    """
    if len(dest) < round_up(length):
        raise ValueError("destination shorter than the padded read")
    fd, _ = open_direct(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < length:
            # Whole blocks even past the end of the file: O_DIRECT needs them; the
            # kernel stops at EOF.
            n = min(WRITE_CHUNK, round_up(length) - pos)
            got = os.preadv(fd, [dest[pos : pos + n]], offset + pos)
            if got <= 0:
                raise ValueError(f"{path} ends {length - pos} bytes early")
            pos += got
    finally:
        os.close(fd)


def data_offset(path: Path) -> int:
    """Where the data section of a safetensors file starts (8 + header length)."""
    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is too short to be a safetensors file")
    return 8 + int.from_bytes(raw, "little")


@dataclass(frozen=True)
class Recovery:
    """What start-up recovery found."""

    manifests: list[Manifest]
    removed_staging: int
    skipped: list[str]


class LocalStore:
    """Filesystem operations of the local tier. Blocking: call from worker threads."""

    def __init__(self, root: Path, spare_max_bytes: int = 0) -> None:
        self.root = root
        self.spare_root = root / ".spare"
        self.spare_max_bytes = spare_max_bytes
        """Evicted rank files kept (up to this many bytes) for new saves to overwrite."""
        self._spares: dict[Path, int] = {}
        self._spare_lock = threading.Lock()
        self.staging_root = root / ".staging"
        self.cache_root = root / ".cache"
        self.corrupt_root = root / ".corrupt"
        self.trash_root = root / ".trash"
        self.peers_root = root / ".peers"
        """Other nodes' parts of steps, fetched for restores that reshard across nodes."""

    def step_dir(self, job: str, step: int) -> Path:
        """Where a committed step lives."""
        return self.root / job / str(step)

    def recover(self) -> Recovery:
        """Remove staging/cache leftovers and rescan committed steps."""
        self.root.mkdir(parents=True, exist_ok=True)
        removed = 0
        leftover_dirs = (
            self.staging_root,
            self.cache_root,
            self.corrupt_root,
            self.trash_root,
            self.spare_root,
            self.peers_root,
        )
        for leftovers in leftover_dirs:
            if leftovers.exists():
                removed += sum(1 for _ in leftovers.iterdir())
                shutil.rmtree(leftovers)
            leftovers.mkdir(mode=0o750)
        fsync_dir(self.root)
        manifests: list[Manifest] = []
        skipped: list[str] = []
        for job_dir in sorted(self.root.iterdir()):
            if job_dir.name.startswith(".") or not job_dir.is_dir():
                continue
            for step_dir in job_dir.iterdir():
                if not step_dir.name.isdigit():
                    continue
                try:
                    manifest = Manifest.from_json((step_dir / MANIFEST).read_text())
                    if manifest.job != job_dir.name or manifest.step != int(step_dir.name):
                        raise ValueError("manifest names another job or step")
                except (OSError, ValueError) as exc:
                    skipped.append(f"{step_dir}: {exc}")
                    continue
                manifests.append(manifest)
        return Recovery(manifests, removed, skipped)

    def new_staging_dir(self, job: str, step: int) -> Path:
        """A fresh directory on the same filesystem as the final one."""
        path = self.staging_root / f"{job}.{step}.{secrets.token_hex(4)}"
        path.mkdir(mode=0o750)
        return path

    def commit(self, staging: Path, manifest: Manifest) -> Path:
        """Write the manifest and rename the staging dir into place (the commit point)."""
        mpath = staging / MANIFEST
        write_synced(mpath, manifest.to_json().encode())
        return self.install(staging, manifest.job, manifest.step)

    def install(self, staging: Path, job: str, step: int) -> Path:
        """Rename a complete, fsynced directory into ``<root>/<job>/<step>`` (the commit point)."""
        fsync_dir(staging)
        final = self.step_dir(job, step)
        job_dir = final.parent
        if not job_dir.exists():
            job_dir.mkdir(mode=0o750, exist_ok=True)
            fsync_dir(self.root)
        if final.exists():
            raise Conflict(f"step {step} of job {job!r} is already committed")
        faults.hit("commit.before_rename")
        os.rename(staging, final)
        fsync_dir(job_dir)
        return final

    def peer_dir(self, job: str, step: int, node: str) -> Path:
        """Where another node's part of a step lives once fetched."""
        return self.peers_root / f"{job}.{step}.{node}"

    def install_peer(self, tmp: Path, job: str, step: int, node: str) -> None:
        """Rename a verified, fsynced download into :meth:`peer_dir`."""
        self.peers_root.mkdir(mode=0o750, exist_ok=True)
        fsync_dir(tmp)
        os.rename(tmp, self.peer_dir(job, step, node))

    def new_cache_dir(self, job: str, step: int) -> Path:
        """A fresh directory for a download from the remote tier (same filesystem)."""
        path = self.cache_root / f"{job}.{step}.{secrets.token_hex(4)}"
        path.mkdir(mode=0o750)
        return path

    def evict(self, job: str, step: int) -> None:
        """Remove a committed step: renamed out of view first (durably), then deleted.

        Its rank files become spares (up to ``spare_max_bytes``) that later
        saves overwrite in place.
        """
        final = self.step_dir(job, step)
        gone = self.trash_root / f"{job}.{step}.{secrets.token_hex(4)}"
        os.rename(final, gone)
        fsync_dir(final.parent)
        for peer in self.peers_root.glob(f"{job}.{step}.*"):
            shutil.rmtree(peer, ignore_errors=True)
        for f in sorted(gone.glob("rank-*.safetensors")):
            size = f.stat().st_size
            with self._spare_lock:
                if sum(self._spares.values()) + size > self.spare_max_bytes:
                    break
                spare = self.spare_root / secrets.token_hex(8)
                os.rename(f, spare)
                self._spares[spare] = size
        shutil.rmtree(gone, ignore_errors=True)

    def take_spare(self, size: int) -> Path | None:
        """The smallest spare file of at least ``size`` bytes, removed from the pool."""
        with self._spare_lock:
            fits = [(n, p) for p, n in self._spares.items() if n >= size]
            if not fits:
                return None
            _, path = min(fits)
            del self._spares[path]
            return path

    @property
    def spare_bytes(self) -> int:
        """Disk space held by spare files (given back by :meth:`drop_spares`)."""
        with self._spare_lock:
            return sum(self._spares.values())

    def drop_spares(self) -> int:
        """Delete every spare file (the disk is short of space); returns the bytes freed."""
        with self._spare_lock:
            spares, self._spares = self._spares, {}
        for path in spares:
            path.unlink(missing_ok=True)
        return sum(spares.values())

    def discard(self, staging: Path) -> None:
        """Remove a staging directory after a failed save."""
        shutil.rmtree(staging, ignore_errors=True)
