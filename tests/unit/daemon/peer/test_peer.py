"""The peer tier's parts without daemons: the replica store a peer writes into, the
bandwidth cap, the ring that places replicas."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import google_crc32c
import pytest

from ckptd.core.errors import InvalidArgument, NotFound, ResourceExhausted
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.core.names import UNKNOWN_OWNER as NO_OWNER
from ckptd.daemon.local.lease import Want
from ckptd.daemon.peer import source as peer_source
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.link import (
    Limiter,
    Peer,
    Peers,
    owner_message,
    owner_of_message,
    read_token,
)
from ckptd.daemon.peer.replicas import Held, ReplicaStore
from ckptd.daemon.peer.source import PeerSource
from ckptd.proto import ckptd_pb2 as pb


def _manifest(step: int, files: dict[str, bytes], job: str = "j", node: str = "src") -> str:
    ranks = [
        RankRecord(i, name, len(data), google_crc32c.value(data), None)
        for i, (name, data) in enumerate(files.items())
    ]
    return Manifest(job, step, node, len(ranks), 1.0, ranks).to_json()


FILES = {"rank-00000.safetensors": b"a" * 5000, "rank-00001.safetensors": b"b" * 3000}


def _put(store: ReplicaStore, step: int, chunks: list[bytes], files: dict[str, bytes] = FILES):
    incoming = store.begin("j", step, _manifest(step, files))
    assert isinstance(incoming, Incoming)
    try:
        for c in chunks:
            incoming.write(c)
        return incoming.finish()
    except BaseException:
        incoming.abort()
        raise


def test_a_replica_lands_whole_across_any_chunking_and_replaces_the_older(
    tmp_path: Path,
) -> None:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    data = b"".join(FILES.values())
    held = _put(store, 1, [data[:1], data[1:4999], data[4999:5001], data[5001:]])
    assert (held.step, held.size) == (1, 8000)
    assert store.path("j", "src", 1, "rank-00001.safetensors").read_bytes() == b"b" * 3000
    _put(store, 2, [data])
    assert [h.step for h in store.list()] == [2]
    # Sent again by a source that restarted: held already, nothing to receive.
    assert isinstance(store.begin("j", 2, _manifest(2, FILES)), Held)
    assert not (tmp_path / ".replicas" / "j" / "src" / "1").exists()
    with pytest.raises(NotFound):
        store.path("j", "src", 1, "rank-00000.safetensors")
    with pytest.raises(NotFound, match="not a file"):
        store.path("j", "src", 2, "../../etc/passwd")
    # A restart finds it (and nothing of a replica that was being received).
    half = store.begin("j", 3, _manifest(3, FILES))
    assert isinstance(half, Incoming)
    half.write(data[:10])
    again = ReplicaStore(tmp_path, 10**6)
    assert again.load() == 1 and [h.step for h in again.list()] == [2]
    assert list((tmp_path / ".replicas" / ".incoming").iterdir()) == []


def test_a_later_timelines_replica_replaces_a_higher_step(tmp_path: Path) -> None:
    """After a rollback the source's newest save has a lower number (core/timeline.py):
    its replica still replaces the old one, under the same number too."""
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    data = b"".join(FILES.values())
    _put(store, 5, [data])

    def forked(step: int, start: int) -> str:
        ranks = [
            RankRecord(i, name, len(d), google_crc32c.value(d), None)
            for i, (name, d) in enumerate(FILES.items())
        ]
        return Manifest("j", step, "src", 2, 1.0, ranks, timeline=1, forks=((1, start),)).to_json()

    for step in (3, 5):  # a lower number, then the same number, of timeline 1
        incoming = store.begin("j", step, forked(step, 3))
        assert isinstance(incoming, Incoming)
        incoming.write(data)
        held = incoming.finish()
        assert (held.step, held.timeline) == (step, 1)
        assert [(h.step, h.timeline) for h in store.list()] == [(step, 1)]
        assert store.path("j", "src", step, "rank-00000.safetensors").read_bytes() == b"a" * 5000
    again = ReplicaStore(tmp_path, 10**6)
    assert again.load() == 1 and [(h.step, h.timeline) for h in again.list()] == [(5, 1)]


@pytest.mark.parametrize(
    "chunks,error",
    [
        ([b"a" * 4999 + b"x" + b"b" * 3000], "crc32c"),
        ([b"a" * 5000, b"b" * 3000, b"!"], "more bytes"),
        ([b"a" * 5000], "ended before rank-00001"),
    ],
)
def test_a_bad_stream_leaves_nothing(tmp_path: Path, chunks: list[bytes], error: str) -> None:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    with pytest.raises(InvalidArgument, match=error):
        _put(store, 1, chunks)
    assert store.list() == []
    assert list((tmp_path / ".replicas" / ".incoming").iterdir()) == []


def test_names_and_budget_are_checked_before_a_byte_is_written(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, 9000)
    store.load()
    with pytest.raises(InvalidArgument):
        store.begin("../x", 1, _manifest(1, FILES))
    with pytest.raises(InvalidArgument, match="names"):
        store.begin("other-job", 1, _manifest(1, FILES))  # the manifest says job "j"
    with pytest.raises(Exception, match=r"malformed|file"):
        store.begin("j", 1, _manifest(1, {"../evil": b"x"}))
    _put(store, 1, [b"".join(FILES.values())])
    # The replacement of the same (job, node) counts without the one it replaces...
    _put(store, 2, [b"".join(FILES.values())])
    # ... another node's does not fit beside it.
    other = _manifest(1, FILES, node="other")
    with pytest.raises(ResourceExhausted, match="peer_budget_bytes"):
        store.begin("j", 1, other)


def test_the_bandwidth_cap_holds_a_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    slept: list[float] = []

    async def run() -> None:
        limiter = Limiter(1000.0, clock=lambda: now[0])
        for _ in range(5):
            await limiter.take(500)

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    asyncio.run(run())
    # 2,500 bytes at 1,000 per second with one second's worth to start with.
    assert sum(slept) == pytest.approx(1.5)


def test_replicas_go_to_the_next_nodes_by_name() -> None:
    async def ring(me: str) -> list[str]:
        peers = Peers(me, (), "t" * 16)
        peers._known = [Peer(n, f"{n}:1") for n in ("a", "b", "d")]
        peers._at = float("inf")  # no asking again
        return [p.node for p in await peers.ring()]

    assert asyncio.run(ring("c")) == ["d", "a", "b"]
    assert asyncio.run(ring("a")) == ["b", "d"]


def test_the_token_file_must_hold_a_real_token(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("abc\n")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(InvalidArgument, match="at least 16"):
        read_token(str(tmp_path / "short"))
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "good").write_text("  " + "x" * 32 + "\n")
    (tmp_path / "good").chmod(0o600)
    assert read_token(str(tmp_path / "good")) == "x" * 32


def test_replication_waits_while_a_save_is_being_written() -> None:
    from types import SimpleNamespace

    from ckptd.daemon.catalog import Catalog
    from ckptd.daemon.peer.replicator import Replicator

    async def run() -> None:
        catalog = Catalog("n")
        peers = SimpleNamespace()
        rep = Replicator(catalog, None, None, peers, 1, Limiter(1e9))  # type: ignore[arg-type]
        assert rep.saves_idle.is_set()
        st = catalog.begin("j", 1)  # a save handed off: STAGING
        assert not rep.saves_idle.is_set()
        manifest = Manifest(
            "j", 1, "n", 1, 1.0, [RankRecord(0, "rank-00000.safetensors", 0, 0, None)]
        )
        catalog.committed(st, manifest)  # LOCAL: the disk is the replicator's again
        assert rep.saves_idle.is_set()
        other = catalog.begin("j", 2)
        assert not rep.saves_idle.is_set()
        catalog.failed(other, "gone", "local")
        assert rep.saves_idle.is_set()

    asyncio.run(run())


def test_replication_yields_to_saves_for_at_most_the_max_lag() -> None:
    """A continuous save loop leaves no gap between saves: once the job's replica has
    been behind for ``max_lag``, replication stops waiting for one."""
    from types import SimpleNamespace

    from ckptd.daemon.catalog import Catalog
    from ckptd.daemon.peer.replicator import Replicator

    now = [100.0]

    async def run() -> None:
        catalog = Catalog("n")
        rep = Replicator(
            catalog, None, None, SimpleNamespace(), 1, Limiter(1e9), 30.0, lambda: now[0]
        )  # type: ignore[arg-type]
        manifest = Manifest(
            "j", 1, "n", 1, 1.0, [RankRecord(0, "rank-00000.safetensors", 0, 0, None)]
        )
        catalog.committed(catalog.begin("j", 1), manifest)  # LOCAL at t=100: behind
        catalog.begin("j", 2)  # the next save is being written
        assert not rep.saves_idle.is_set()
        waiting = asyncio.ensure_future(rep.yield_to_saves("j"))
        await asyncio.sleep(0)
        assert not waiting.done()  # 0 s behind: it yields
        waiting.cancel()
        now[0] = 130.5  # behind for longer than max_lag: it goes on at once
        await asyncio.wait_for(rep.yield_to_saves("j"), 5)
        assert not rep.saves_idle.is_set()

    asyncio.run(run())


class _Catalog:
    @contextlib.contextmanager
    def in_use(self, st: Any) -> Iterator[Any]:
        yield st


class _Io:
    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


class _Memory:
    """Shared memory that hands out numbered leases and records what became of them."""

    def __init__(self) -> None:
        self.leases: list[int] = []
        self.kept: list[tuple[int, int]] = []  # (rank, lease)
        self.released: list[int] = []

    async def lease_for(self, job: str, size: int) -> Any:
        self.leases.append(len(self.leases))
        return SimpleNamespace(segment=self.leases[-1])

    def keep(self, job: str, step: int, rank: int, lease: Any, holds: tuple[int, int]) -> None:
        self.kept.append((rank, lease.segment))

    def release(self, lease: Any) -> None:
        self.released.append(lease.segment)


def test_staging_stops_once_a_restore_has_read_the_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trainer's restore came while rank 1 was being staged: that segment goes
    back, rank 2 is never staged (nobody would claim it: it would hold its memory
    until the lease timeout); rank 0's, staged before, stays for its restore."""
    st = SimpleNamespace(job="j", step=3, read_at=1.0)
    ranks = [RankRecord(r, f"rank-{r:05d}.safetensors", 10 * (r + 1), 0, None) for r in range(3)]
    staged: list[int] = []

    def stage_file(path: Path, segment: int, record: RankRecord) -> None:
        staged.append(record.rank)
        if record.rank == 1:
            st.read_at = 2.0  # a restore served the step (catalog.served)

    monkeypatch.setattr(peer_source, "_stage_file", stage_file)
    store = SimpleNamespace(step_dir=lambda job, step: tmp_path)
    fetcher = PeerSource(_Catalog(), store, _Io(), None)  # type: ignore[arg-type]
    memory = fetcher.memory = _Memory()
    try:
        manifest = SimpleNamespace(ranks=ranks, timeline=1)
        asyncio.run(fetcher._stage(st, manifest))  # type: ignore[arg-type]
    finally:
        fetcher.close()
    assert staged == [0, 1]
    assert memory.kept == [(0, 0)] and memory.released == [1] and memory.leases == [0, 1]
    assert fetcher.staged_bytes == 10


def test_a_restore_while_another_takes_the_job_back_from_peers_waits_for_it() -> None:
    """Two ranks restore at once on a node that lost its disk: the second asks the
    peers' holdings before the first has brought the step (the last answer stands:
    the peers were asked a moment ago), then waits for the first's fetch and finds the
    step local; it is fetched once. A replica whose manifest does not parse is no
    step of the peers'."""
    from ckptd.daemon.catalog import Catalog

    catalog = Catalog("n")
    source = PeerSource(catalog, None, None, SimpleNamespace())  # type: ignore[arg-type]
    peer = Peer("b", "10.0.0.2:7000")
    fetching, done, fetched = asyncio.Event(), asyncio.Event(), []

    async def replicas(job: str = "", source: str | None = None) -> Any:
        return {
            ("j", 4): [(peer, _manifest(4, FILES, node="n"), NO_OWNER)],
            ("j", 5): [(peer, "{", NO_OWNER)],
        }

    async def fetch(job: str, step: int, replica: Any, rank: int | None = None) -> None:
        fetched.append(step)
        fetching.set()
        await done.wait()
        catalog.peer_fetched(replica.manifest, "b")

    source.replicas = replicas  # type: ignore[method-assign]
    source.fetch = fetch  # type: ignore[method-assign]

    async def run() -> list[Any]:
        asked = [await source.holds("j", None), await source.holds("j", None)]
        first = asyncio.ensure_future(source.bring("j", 4, Want(0)))
        await fetching.wait()
        second = asyncio.ensure_future(source.bring("j", 4, Want(1)))
        done.set()
        return [*asked, await first, await second, await source.holds("j", None)]

    try:
        answers = asyncio.run(run())
    finally:
        source.close()
    assert answers == [[(True, 0, 4)], [(True, 0, 4)], None, None, []]
    assert fetched == [4] and catalog.require("j", 4).local


def test_only_a_replica_whose_manifest_parses_is_a_step_of_the_peers() -> None:
    """A node that lost its disk lists its replicas: one whose manifest is JSON but no
    manifest ckptd can read (a newer format, say) is no step of the peers' (the
    chooser goes to the bucket for it, not to a fetch that must fail), and a step
    whose first holder's copy is bad is taken from the holder whose copy is sound."""
    from ckptd.daemon.catalog import Catalog

    catalog = Catalog("n")
    source = PeerSource(catalog, None, None, SimpleNamespace())  # type: ignore[arg-type]
    b, c = Peer("b", "10.0.0.2:7000"), Peer("c", "10.0.0.3:7000")
    unreadable = _manifest(6, FILES, node="n").replace('"format_version":2', '"format_version":99')
    sound = _manifest(5, FILES, node="n")
    taken: list[Any] = []

    async def replicas(job: str = "", source: str | None = None) -> Any:
        return {
            ("j", 6): [(b, unreadable, NO_OWNER)],
            ("j", 5): [(b, "{", NO_OWNER), (c, sound, NO_OWNER)],
        }

    async def fetch(job: str, step: int, replica: Any, rank: int | None = None) -> None:
        taken.append((step, replica.text, replica.peers))
        catalog.peer_fetched(replica.manifest, "c")

    source.replicas = replicas  # type: ignore[method-assign]
    source.fetch = fetch  # type: ignore[method-assign]

    async def run() -> None:
        assert await source.holds("j", None) == [(True, 0, 5)]
        assert await source.bring("j", 5, Want(0)) is None

    try:
        asyncio.run(run())
    finally:
        source.close()
    assert taken == [(5, sound, [c])]


def test_a_job_taken_back_from_peers_is_told_its_owner_before_it_is_listed() -> None:
    """A node that lost its disk takes a job back from its peers: the owner the replica
    came with is told before the step is in the catalog (else the first caller of any
    uid would find it open), and it crosses the wire as the source said it."""
    from ckptd.daemon.catalog import Catalog

    for said in [(1001, True), (None, True), (-1, True), NO_OWNER]:
        message = pb.Replica(owner=owner_message(said))
        assert owner_of_message(pb.Replica.FromString(message.SerializeToString())) == said
    catalog = Catalog("n")
    told: list[Any] = []

    def owner_found(job: str, owner: int | None, known: bool) -> None:
        told.append((job, owner, known, catalog.get(job, 4)))

    source = PeerSource(catalog, None, None, SimpleNamespace(), owner_found=owner_found)  # type: ignore[arg-type]
    peer = Peer("b", "10.0.0.2:7000")

    async def replicas(job: str = "", source: str | None = None) -> Any:
        return {("j", 4): [(peer, _manifest(4, FILES, node="n"), (1001, True))]}

    async def commit(replica: Any) -> str:
        return "b"

    source.replicas = replicas  # type: ignore[method-assign]
    source._commit = commit  # type: ignore[method-assign]

    async def run() -> None:
        await source.holds("j", None)
        await source.bring("j", 4, Want(0))

    try:
        asyncio.run(run())
    finally:
        source.close()
    assert told == [("j", 1001, True, None)] and catalog.require("j", 4).local


def test_a_replica_of_another_save_than_the_step_known_here_is_not_taken() -> None:
    """The bucket says this node's step 4 is of timeline 1 (a rerun saved it again while
    the peer was down); the peer's replica of step 4 is timeline 0's, the save that
    rerun replaced: not taken (the bucket is next)."""
    from ckptd.core.errors import DataLoss
    from ckptd.daemon.catalog import Catalog
    from ckptd.daemon.peer.references import Replica

    catalog = Catalog("n")
    assert catalog.discovered("j", 4, {"n"}, False, timeline=1, forks=((1, 0),)) is not None
    source = PeerSource(catalog, None, None, SimpleNamespace())  # type: ignore[arg-type]
    text = _manifest(4, FILES, node="n")
    replica = Replica(Manifest.from_json(text), text, [Peer("b", "10.0.0.2:7000")])
    try:
        with pytest.raises(DataLoss, match="timeline 0, the step known here of 1"):
            asyncio.run(source.fetch("j", 4, replica))
    finally:
        source.close()
    assert not catalog.require("j", 4).local


def test_a_replica_of_a_later_save_than_the_buckets_replaces_it() -> None:
    """The bucket holds this node's steps 4 and 5 of timeline 0; the peer's replica of
    step 4 is of timeline 1, a rollback's save the bucket never got (it was away): the
    replica is taken and replaces the bucket's older save under that number (which the
    drain retracts), and step 5 is abandoned."""
    import dataclasses

    from ckptd.daemon.catalog import Catalog
    from ckptd.daemon.peer.references import Replica

    catalog = Catalog("n")
    for step in (4, 5):
        assert catalog.discovered("j", step, {"n"}, False, timeline=0) is not None
    later = dataclasses.replace(
        Manifest.from_json(_manifest(4, FILES, node="n")), timeline=1, forks=((1, 4),)
    )
    text = later.to_json()
    replica = Replica(Manifest.from_json(text), text, [Peer("b", "10.0.0.2:7000")])
    source = PeerSource(catalog, None, None, SimpleNamespace())  # type: ignore[arg-type]

    async def commit(replica: Any) -> str:
        return "b"

    source._commit = commit  # type: ignore[method-assign]
    try:
        asyncio.run(source.fetch("j", 4, replica))
    finally:
        source.close()
    st = catalog.require("j", 4)
    assert st.local and st.timeline == 1 and not st.in_remote
    assert catalog.require("j", 5).abandoned
    assert catalog.replaced_numbers("j") == {4: 1}
    # The bucket's copy, listed again before the drain retracted it, is not this step.
    assert catalog.discovered("j", 4, {"n"}, False, timeline=0) is None
    assert catalog.require("j", 4).timeline == 1 and not catalog.require("j", 4).in_remote
