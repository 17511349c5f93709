"""Reading a replica's files from the peers holding it, checked against the manifest.

Each rank file comes from a holder in turn (a peer that dies mid-transfer: the
file starts again from the next holder), as :data:`RANGE_BYTES` ranges over
:data:`STREAMS` connections to the holder's bulk listener (bulk.py), or through
its ``GetReplicaFile`` stream from a daemon without one, and is checked against
the crc32c in the manifest before the caller commits it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.proto import ckptd_pb2 as pb

from ..io import IoPool
from .bulk_client import read_range
from .link import Peer, Peers

log = logging.getLogger("ckptd.peer")

FILE_TIMEOUT_SECONDS = 3600.0
STREAMS = 4
"""Connections reading replica bytes at once (the files of a step share them)."""
RANGE_BYTES = 64 * 2**20
"""Bytes per ranged read: a big file is read over several connections at once."""
BUFFER_BYTES = 4 * 2**20


def _check(record: RankRecord, crc: int, size: int) -> None:
    """DataLoss unless the bytes that came are the manifest's."""
    if size != record.size or crc != record.crc32c:
        raise DataLoss(
            f"{record.file} came as {size} bytes with crc32c {crc:08x}, not "
            f"{record.size} with {record.crc32c:08x}"
        )


class _Placer:
    """Writes a file's bytes at their offset (from any stream thread)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, piece: memoryview, at: int) -> None:
        done = 0
        while done < len(piece):
            done += os.pwrite(self.fd, piece[done:], at + done)


class ReplicaReader:
    """Rank files of a replica from its holders, over stream threads of its own."""

    def __init__(self, io: IoPool, peers: Peers) -> None:
        self.io, self.peers = io, peers
        self.fetched_bytes = 0
        """Bytes taken from peers (metrics)."""
        # Blocking socket reads: their own threads, never the I/O pool's, which
        # saves need while a restore is under way.
        self._streams = concurrent.futures.ThreadPoolExecutor(STREAMS, "ckptd-peer-get")
        self._fell_back_from: set[str] = set()  # peers whose bulk failure was logged
        self._buffers = threading.local()

    def close(self) -> None:
        """Stop the stream threads (a transfer under way ends with its connection)."""
        self._streams.shutdown(wait=False, cancel_futures=True)

    async def file(
        self, directory: Path, manifest: Manifest, record: RankRecord, order: list[Peer]
    ) -> str:
        """One rank file into ``directory`` from the first holder in ``order`` that
        gives all of it (its node name)."""
        path = directory / record.file
        reasons = []
        for peer in order:
            try:
                await self._download(peer, manifest, record, str(path))
                return peer.node
            except Exception as exc:  # dead mid-transfer, refused, corrupt: the next one
                reasons.append(f"{peer.node}: {exc}")
                self.peers.fail(f"{peer.node} ({peer.address})", exc)
        raise NotFound(f"no peer gave {record.file} whole: {'; '.join(reasons)}")

    async def _download(
        self, peer: Peer, manifest: Manifest, record: RankRecord, path: str
    ) -> None:
        fd = await self.io.run(
            os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640
        )
        try:
            place = _Placer(fd)
            if peer.data_port:
                try:
                    _check(record, *await self._ranges(peer, manifest, record, place))
                except (DataLoss, Unavailable) as exc:
                    # Refused, cut, timed out or corrupt on the bulk listener: the same
                    # peer's gRPC service may still give it (its own port, flow control).
                    self._fell_back(peer, exc)
                    _check(record, *await self._stream(peer, manifest, record, place))
            else:
                _check(record, *await self._stream(peer, manifest, record, place))
            await self.io.run(os.fsync, fd)
        finally:
            os.close(fd)

    def _fell_back(self, peer: Peer, exc: Exception) -> None:
        """Log, once per peer, a bulk read that failed over to gRPC."""
        if peer.node not in self._fell_back_from:
            self._fell_back_from.add(peer.node)
            log.warning("peer %s: replica data port failed (%s); reading through its "
                        "Peer service instead", peer.node, exc)  # fmt: skip

    async def _ranges(
        self, peer: Peer, manifest: Manifest, record: RankRecord, place: _Placer
    ) -> tuple[int, int]:
        """The file from ``peer``'s bulk listener, its ranges in parallel; (crc32c,
        size)."""
        request = {
            "job": manifest.job,
            "source": manifest.node,
            "step": manifest.step,
            "file": record.file,
        }
        spans = [(o, min(RANGE_BYTES, record.size - o)) for o in range(0, record.size, RANGE_BYTES)]
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(
                loop.run_in_executor(self._streams, self._range, peer, request, place, o, n)
                for o, n in spans
            ),
            return_exceptions=True,  # every thread done with fd before it is closed
        )
        crcs = [r for r in done if not isinstance(r, BaseException)]
        if len(crcs) < len(done):
            raise next(r for r in done if isinstance(r, BaseException))
        self.fetched_bytes += record.size
        crc = checksum.combine_all([(c, n) for c, (_, n) in zip(crcs, spans, strict=True)])
        return crc, record.size

    def _range(
        self, peer: Peer, request: dict[str, object], place: _Placer, offset: int, length: int
    ) -> int:
        """One range, written at its place (a stream thread); its crc32c."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = self._buffers.buf = memoryview(bytearray(BUFFER_BYTES))
        at = offset

        def sink(piece: memoryview) -> None:
            nonlocal at
            place(piece, at)
            at += len(piece)

        req = {**request, "offset": offset, "length": length}
        tls, name = self.peers.tls, peer.host
        return read_range(peer.data_address, self.peers.token, req, buf, sink, tls, name)

    async def _stream(
        self, peer: Peer, manifest: Manifest, record: RankRecord, place: _Placer
    ) -> tuple[int, int]:
        """The file from ``peer``'s ``GetReplicaFile`` (a daemon without a bulk
        listener); (crc32c, size)."""
        crc, size = 0, 0
        call = self.peers.stub(peer.address).GetReplicaFile(
            pb.GetReplicaFileRequest(
                job=manifest.job,
                source_node=manifest.node,
                step=manifest.step,
                file=record.file,
            ),
            metadata=self.peers.metadata,
            timeout=FILE_TIMEOUT_SECONDS,
        )
        async for chunk in call:
            if size + len(chunk.data) > record.size:
                raise DataLoss(f"{record.file} is longer than its {record.size} bytes")
            await self.io.run(place, memoryview(chunk.data), size)
            crc = checksum.extend(crc, chunk.data)
            size += len(chunk.data)
            self.fetched_bytes += len(chunk.data)
        return crc, size
