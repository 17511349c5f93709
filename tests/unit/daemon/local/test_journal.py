"""The journal read back after damage and with crafted records: every intact record
is replayed, every refused one is named, and nothing stops the daemon's start."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import checksum
from ckptd.daemon.app.startup import parse_record
from ckptd.daemon.local.journal import JOURNAL, Entry, Journal
from ckptd.daemon.local.journal_format import MARKER, frame, scan
from ckptd.proto import ckptd_pb2 as pb

SAVES = [
    ("lease-a", "seg-a", "alpha", 1),
    ("lease-b", "seg-b", "beta", 2),
    ("lease-c", "seg-c", "gamma", 3),
]


def body(lease: str, job: str, step: int) -> bytes:
    """A journaled request as the daemon writes it."""
    return pb.CommitShardsRequest(lease_id=lease, job=job, step=step, rank=0).SerializeToString()


def written(root: Path, saves: list[tuple[str, str, str, int]] = SAVES) -> bytes:
    """The journal a daemon leaves after acknowledging ``saves`` (none of them LOCAL)."""
    journal = Journal(root)
    journal.load()

    async def commit() -> None:
        for lease, seg, job, step in saves:
            await journal.commit(lease, seg, job, body(lease, job, step), (0, ()), step)

    asyncio.run(commit())
    journal.close()
    return (root / JOURNAL).read_bytes()


def load(root: Path, data: bytes) -> tuple[list[Entry], Journal]:
    (root / JOURNAL).write_bytes(data)
    journal = Journal(root)
    entries = journal.load(parse_record)
    journal.close()
    return entries, journal


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


# Where in the first record the byte flips: its marker, length, crc, JSON header, body.
PLACES = {"marker": 1, "length": 5, "crc": 9, "header": 14, "body": -1}


@pytest.mark.parametrize("place", PLACES)
def test_a_flipped_byte_in_the_first_record_loses_only_that_record(
    tmp_path: Path, place: str
) -> None:
    data = written(tmp_path)
    first = scan(data).records[0]
    at, size = first[0], first[1]
    data = flip(data, at + PLACES[place] if PLACES[place] >= 0 else at + size - 1)
    entries, journal = load(tmp_path, data)
    if place == "marker":
        # Past the damaged marker the record reads as one of the earlier framing: kept.
        assert [e.job for e in entries] == ["alpha", "beta", "gamma"]
        assert [lost.harmless for lost in journal.lost] == [True]
        return
    assert [(e.job, e.step) for e in entries] == [("beta", 2), ("gamma", 3)]
    assert len(journal.lost) == 1 and not journal.lost[0].harmless
    lost = journal.lost[0]
    if place != "header":  # the header's text still names the save
        assert (lost.op, lost.job, lost.step, lost.lease) == ("commit", "alpha", 1, "lease-a")
        assert "'alpha' step 1" in lost.describe()
    else:
        assert lost.offset == 0 and lost.nbytes == size
    # The file is rewritten with the replayable records only; reading it again agrees.
    again, journal = load(tmp_path, (tmp_path / JOURNAL).read_bytes())
    assert again == entries and journal.lost == []


def test_damage_in_the_middle_skips_only_the_damaged_bytes(tmp_path: Path) -> None:
    data = written(tmp_path)
    second = scan(data).records[1]
    junk = data[: second[0] + 20] + b"\x00" * (second[1] - 20) + data[second[0] + second[1] :]
    entries, journal = load(tmp_path, junk)
    assert [e.job for e in entries] == ["alpha", "gamma"]
    assert [(lost.job, lost.step) for lost in journal.lost] == [("", None)]
    assert "bytes of the journal" in journal.lost[0].describe()


def test_a_torn_tail_is_dropped_and_is_not_a_lost_save(tmp_path: Path) -> None:
    data = written(tmp_path)
    entries, journal = load(tmp_path, data[:-7])
    assert [e.job for e in entries] == ["alpha", "beta"]
    assert journal.lost == []


def test_zeros_after_the_last_record_are_a_torn_tail(tmp_path: Path) -> None:
    # What a file system may leave of an append that was never synced.
    entries, journal = load(tmp_path, written(tmp_path) + b"\0" * 4096)
    assert [e.job for e in entries] == ["alpha", "beta", "gamma"]
    assert journal.lost == []


def old_frame(header: dict[str, Any], payload_body: bytes = b"") -> bytes:
    """A record as the journal framed it before records carried a marker."""
    payload = json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload_body
    return struct.pack("<II", len(payload), checksum.value(payload)) + payload


def old_journal(saves: list[tuple[str, str, str, int]] = SAVES) -> bytes:
    return b"".join(
        old_frame(
            {"op": "commit", "lease": lease, "segment": seg, "job": job}, body(lease, job, step)
        )
        for lease, seg, job, step in saves
    )


def test_a_journal_of_the_earlier_framing_is_read_whole_and_rewritten(tmp_path: Path) -> None:
    entries, journal = load(tmp_path, old_journal())
    assert [(e.job, e.step) for e in entries] == [("alpha", 1), ("beta", 2), ("gamma", 3)]
    assert journal.lost == []
    rewritten = (tmp_path / JOURNAL).read_bytes()
    assert rewritten.startswith(MARKER)
    assert load(tmp_path, rewritten)[0] == entries


def test_a_damaged_record_of_the_earlier_framing_loses_only_itself(tmp_path: Path) -> None:
    data = old_journal()
    entries, journal = load(tmp_path, flip(data, len(old_journal(SAVES[:1])) - 1))
    assert [e.job for e in entries] == ["beta", "gamma"]
    assert [(lost.job, lost.lease) for lost in journal.lost] == [("alpha", "lease-a")]


def test_a_record_whose_done_record_is_damaged_is_replayed(tmp_path: Path) -> None:
    commit = written(tmp_path, SAVES[:1])
    data = commit + frame({"op": "done", "lease": "lease-a"})
    entries, journal = load(tmp_path, flip(data, len(commit) + PLACES["crc"]))
    assert [e.job for e in entries] == ["alpha"]
    assert [(lost.op, lost.lease) for lost in journal.lost] == [("done", "lease-a")]


def test_a_later_record_on_the_same_segment_retires_the_earlier(tmp_path: Path) -> None:
    # The segment was granted again, so the earlier save's done record was on disk.
    reused = [SAVES[0], ("lease-z", "seg-a", "alpha", 9)]
    entries, _ = load(tmp_path, written(tmp_path, reused))
    assert [(e.lease_id, e.step) for e in entries] == [("lease-z", 9)]


GOOD = {"op": "commit", "lease": "lease-g", "segment": "seg-g", "job": "good", "step": 5}
BAD = {**GOOD, "segment": "seg-b"}  # another segment: a later record on seg-g retires it
CRAFTED: dict[str, tuple[Any, bytes]] = {
    "header is a list": ([], b""),  # was AttributeError
    "header is null": (None, b""),
    "no segment": ({"op": "commit", "lease": "l1", "job": "j"}, body("l1", "j", 1)),  # KeyError
    "bad protobuf": ({**BAD, "lease": "l2"}, b"\xff\xff\xff"),  # was DecodeError
    "lease not a string": ({**GOOD, "lease": 7}, body("7", "good", 5)),
    "unknown op": ({"op": "erase", "lease": "l3"}, b""),
    "job outside the root": ({**GOOD, "lease": "l4", "job": "../etc"}, body("l4", "../etc", 5)),
    "segment outside /dev/shm": (
        {**GOOD, "lease": "l5", "segment": "../../x"},
        body("l5", "good", 5),
    ),
    "negative step": ({**GOOD, "lease": "l6", "step": -1}, body("l6", "good", 5)),
    "step a string": ({**GOOD, "lease": "l7", "step": "5"}, body("l7", "good", 5)),
    "no body": ({**GOOD, "lease": "l8"}, b""),
    "body of another job": ({**BAD, "lease": "l9"}, body("l9", "other", 5)),
    "body of another lease": ({**BAD, "lease": "l10"}, body("lease-g", "good", 5)),
    "negative step in the body": ({**BAD, "lease": "l11"}, body("l11", "good", -4)),
}


def crafted(header: Any, payload_body: bytes) -> bytes:
    """A record with a valid marker, length and crc around whatever it is given."""
    payload = json.dumps(header).encode() + b"\n" + payload_body
    return MARKER + struct.pack("<II", len(payload), checksum.value(payload)) + payload


@pytest.mark.parametrize("kind", CRAFTED)
def test_a_crafted_record_is_refused_and_the_good_ones_replay(tmp_path: Path, kind: str) -> None:
    good = frame(GOOD, body("lease-g", "good", 5))
    entries, journal = load(tmp_path, crafted(*CRAFTED[kind]) + good)
    assert [(e.lease_id, e.job, e.step) for e in entries] == [("lease-g", "good", 5)]
    assert len(journal.lost) == 1
    assert journal.lost[0].describe()


@pytest.mark.parametrize("header", [b"not json", b"[" * 100_000, b"\xff\xfe"])
def test_a_header_that_is_not_json_is_refused(tmp_path: Path, header: bytes) -> None:
    payload = header + b"\n"
    bad = MARKER + struct.pack("<II", len(payload), checksum.value(payload)) + payload
    good = frame(GOOD, body("lease-g", "good", 5))
    entries, journal = load(tmp_path, bad + good)
    assert [e.lease_id for e in entries] == ["lease-g"]
    assert len(journal.lost) == 1


def test_a_refused_record_on_a_live_segment_does_not_retire_its_save(tmp_path: Path) -> None:
    good = frame(GOOD, body("lease-g", "good", 5))
    bad = crafted({**GOOD, "lease": "l12"}, b"\xff\xff\xff")  # the same segment, later
    entries, journal = load(tmp_path, good + bad)
    assert [e.lease_id for e in entries] == ["lease-g"]
    assert [lost.lease for lost in journal.lost] == ["l12"]
