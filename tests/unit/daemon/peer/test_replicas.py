"""The replica store with incremental replicas (core/increments.py), without daemons:
a replica is taken only when every step it references is held; a step sent ahead
as a holder does not replace the source's newest; what the newest references stays,
the rest goes, at its commit and again at start-up."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import pytest

from ckptd.core.errors import FailedPrecondition
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.peer.incoming import Incoming
from ckptd.daemon.peer.replicas import Held, ReplicaStore

FILE = "rank-00000.safetensors"
FULL = b"f" * 8192
OWN = b"n" * 4096


def _manifest(step: int, data: bytes, refs: tuple[int, ...] = ()) -> str:
    """Step ``step`` of job j from node src: a full file, or (``refs``: the steps held
    referenced) an incremental one of its own run and one 4 KiB range of each."""
    crc = google_crc32c.value(data)
    if not refs:
        record = RankRecord(0, FILE, len(data), crc, None)
    else:
        ranges = [[len(data) + 4096 * i, 4096, h, 0, 0] for i, h in enumerate(refs)]
        image = len(data) + 4096 * len(refs)
        record = RankRecord(0, FILE, len(data), crc, None, [[0, len(data)]], ranges, image, 0)
    return Manifest("j", step, "src", 1, 1.0, [record]).to_json()


def _put(
    store: ReplicaStore, step: int, data: bytes, refs: tuple[int, ...] = (), holder_for: int = 0
) -> Held:
    incoming = store.begin("j", step, _manifest(step, data, refs), holder_for)
    assert isinstance(incoming, Incoming)
    incoming.write(data)
    return incoming.finish()


def _steps(store: ReplicaStore) -> list[int]:
    return [h.step for h in store.list("j", "src")]


def test_an_incremental_replica_needs_its_references_held(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    with pytest.raises(FailedPrecondition, match=r"references step 1.*send that step first"):
        store.begin("j", 2, _manifest(2, OWN, (1,)))
    _put(store, 1, FULL)
    _put(store, 2, OWN, (1,))
    assert _steps(store) == [1, 2]  # step 1 stays: step 2 references it
    _put(store, 3, OWN, (1,))  # step 2 is needed by nothing now
    assert _steps(store) == [1, 3]
    assert not (tmp_path / ".replicas" / "j" / "src" / "2").exists()
    _put(store, 4, FULL)
    assert _steps(store) == [4] and store.held_bytes == len(FULL)


def test_a_step_sent_ahead_as_a_holder_leaves_the_newest_in_place(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    _put(store, 5, FULL)
    # Step 8 references steps 6 and 7, which reference nothing of step 5.
    _put(store, 6, FULL, holder_for=8)
    _put(store, 7, OWN, (6,), holder_for=8)
    assert _steps(store) == [5, 6, 7]  # nothing removed: step 8 is to come
    again = ReplicaStore(tmp_path, 10**6)  # a restart before it came: all stay
    assert again.load() == 3 and _steps(again) == [5, 6, 7]
    _put(again, 8, OWN, (6, 7))
    assert _steps(again) == [6, 7, 8]
    third = ReplicaStore(tmp_path, 10**6)
    assert third.load() == 3 and _steps(third) == [6, 7, 8]


def test_a_replica_keeps_the_owner_its_source_said_across_restarts(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, 10**6)
    store.load()
    incoming = store.begin("j", 1, _manifest(1, FULL), 0, (1001, True))
    assert isinstance(incoming, Incoming)
    incoming.write(FULL)
    assert incoming.finish().owner == (1001, True)
    _put(store, 2, FULL)  # a sender that does not say: not known, never "nobody's"
    assert [h.owner for h in store.list("j")] == [(None, False)]
    # Sent again after `ckptd own` moved the job on the source: the new owner is kept.
    again = store.begin("j", 2, _manifest(2, FULL), 0, (1002, True))
    assert isinstance(again, Held) and again.owner == (1002, True)
    reloaded = ReplicaStore(tmp_path, 10**6)
    reloaded.load()
    assert [h.owner for h in reloaded.list("j")] == [(1002, True)]
    # An operator's job (nobody's, open) is kept as such, not as unknown.
    _put(reloaded, 3, FULL)
    open_job = reloaded.begin("j", 3, _manifest(3, FULL), 0, (None, True))
    assert isinstance(open_job, Held) and open_job.owner == (None, True)
    third = ReplicaStore(tmp_path, 10**6)
    third.load()
    assert [h.owner for h in third.list("j")] == [(None, True)]
