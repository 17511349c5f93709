"""A real ``ckptd serve`` restarted on a damaged or crafted journal: it starts, replays
every intact record, and names the save it could not."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from ckptd.client.handle import SaveHandle
from ckptd.core import checksum
from ckptd.daemon.local.journal import JOURNAL
from ckptd.daemon.local.journal_format import scan

from .conftest import Daemon
from .helpers import state_for

JOBS = {"alpha": 1, "beta": 2, "gamma": 3}


def crashed_with_saves(make_daemon: Any, jobs: dict[str, int]) -> tuple[Daemon, bytes]:
    """A daemon killed with every save of ``jobs`` acknowledged (journaled), none LOCAL;
    and its journal."""
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    for job, step in jobs.items():
        daemon.client(job).save(step, state_for(step, 1), metadata={"s": step})
    daemon.wait_failpoint("write.begin")
    daemon.kill()
    daemon.env = {}
    return daemon, (daemon.root / JOURNAL).read_bytes()


def assert_replayed(daemon: Daemon, job: str, step: int) -> None:
    client = daemon.client(job)
    SaveHandle(client, step).wait("local", timeout=120)
    tree, meta = client.restore(step=step)
    assert meta == {"s": step}
    assert tree["w0"].tobytes() == state_for(step, 1)["w0"].tobytes()


def test_a_flipped_byte_in_the_first_record_loses_only_that_save(make_daemon: Any) -> None:
    daemon, data = crashed_with_saves(make_daemon, JOBS)
    at, size, header, _ = scan(data).records[0]
    lost_job = header["job"]
    lost_step = JOBS[lost_job]
    end = at + size - 1  # the last byte of its request
    data = data[:end] + bytes([data[end] ^ 0x01]) + data[end + 1 :]
    (daemon.root / JOURNAL).write_bytes(data)
    daemon.restart()
    for job, step in JOBS.items():
        if job != lost_job:
            assert_replayed(daemon, job, step)
    # Nothing of the lost save is visible, and the log names it.
    assert daemon.client(lost_job).list() == []
    assert not (daemon.root / lost_job / str(lost_step)).exists()
    named = [line for line in daemon.log_text().splitlines() if f"{lost_job!r} step" in line]
    assert named and f"step {lost_step}" in named[0]


def old_frame(header: Any, body: bytes) -> bytes:
    """A record framed as the journal framed them before records carried a marker
    (still read), with a valid crc around whatever it is given."""
    payload = json.dumps(header, separators=(",", ":")).encode() + b"\n" + body
    return struct.pack("<II", len(payload), checksum.value(payload)) + payload


# Each stopped the daemon's start before: AttributeError, KeyError, DecodeError.
CRAFTED = {
    "header not an object": lambda seg: (["op", "commit"], b""),
    "no segment": lambda seg: ({"op": "commit", "lease": "l1", "job": "crafted"}, b"\x08\x01"),
    "bad protobuf": lambda seg: (
        {"op": "commit", "lease": "l2", "segment": seg, "job": "crafted"},
        b"\xff\xff\xff",
    ),
}


@pytest.mark.parametrize("kind", CRAFTED)
def test_a_crafted_record_leaves_the_daemon_starting(make_daemon: Any, kind: str) -> None:
    daemon, data = crashed_with_saves(make_daemon, {"good": 4})
    # The crafted record names the good save's segment, so that it is not skipped as gone.
    segment = scan(data).records[0][2]["segment"]
    (daemon.root / JOURNAL).write_bytes(old_frame(*CRAFTED[kind](segment)) + data)
    daemon.restart()
    assert_replayed(daemon, "good", 4)
    assert daemon.client("crafted").list() == []
