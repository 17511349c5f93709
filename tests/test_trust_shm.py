"""Journal replay and /dev/shm: the daemon maps only segment files it made.

An acknowledged save's segment is lost (a reboot-like loss), someone plants a
file under its name, and the daemon restarts and replays the journal. The
planted file must be refused (never mapped, never pooled) and the refusal
logged with job, step, path and reason. A segment that survives a daemon
restart, at the current or at an older daemon's location, is still recovered.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client.handle import SaveHandle
from ckptd.daemon.local.segments import (
    SEGMENT_GRANULE,
    SegmentRefused,
    open_trusted,
    prepare_dir,
    segment_dir,
)
from ckptd.daemon.local.staging import segment_prefix

from .conftest import Daemon
from .test_security import USERS, _ensure_users

SHM = Path("/dev/shm")
N = 2**18  # float32s: 1 MiB of tensor data, one 2 MiB segment
VICTIM, PLANTED, NEXT = 7.0, 666.0, 9.0


def _pattern(value: float) -> bytes:
    return np.full(N, value, np.float32).tobytes()


def _crash_with_one_handoff(make_daemon: Any) -> tuple[Daemon, Path, bytes]:
    """A daemon killed after acknowledging step 1 of job "victim" and before writing
    it; returns the daemon, its segment's path and the segment's bytes."""
    daemon: Daemon = make_daemon(env={"CKPTD_FAILPOINTS": "write.begin=pause"})
    client = daemon.client("victim")
    client.save(1, {"w": np.full(N, VICTIM, np.float32)})
    daemon.wait_failpoint("write.begin")
    daemon.kill()
    prefix = segment_prefix(daemon.root)
    where = [*SHM.glob(prefix + "*"), *segment_dir(prefix).glob("*")]
    assert len(where) == 1, where  # the one acknowledged handoff's segment
    return daemon, where[0], where[0].read_bytes()


def _restart_and_replay(daemon: Daemon) -> None:
    daemon.env = {}
    daemon.restart()  # start() returns once the journal is replayed and it serves


def _maps(daemon: Daemon) -> str:
    assert daemon.proc is not None
    return Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def _next_save_elsewhere(daemon: Daemon) -> None:
    """The victim's next save completes, and step 1 came from no planted file."""
    client = daemon.client("victim")
    assert 1 not in [c.step for c in client.list()], "a planted file was restored as step 1"
    client.save(2, {"w": np.full(N, NEXT, np.float32)}).wait("local")
    tree, _ = client.restore(step=2)
    assert tree["w"].tobytes() == _pattern(NEXT)
    del tree


def _plant_as(user: str, path: Path, data: bytes) -> bool:
    """Create ``path`` (mode 0666) holding ``data`` as ``user``; whether it could."""
    out = subprocess.run(
        ["/bin/sh", "-c", 'umask 0; cat > "$1"', "sh", str(path)],
        input=data,
        user=user,
        capture_output=True,
        timeout=60,
    )
    return out.returncode == 0


def test_a_regular_file_another_user_plants_is_never_adopted(make_daemon: Any) -> None:
    _ensure_users()
    attacker = USERS[1]
    daemon, seg, image = _crash_with_one_handoff(make_daemon)
    assert _pattern(VICTIM) in image
    seg.unlink()  # the segment is lost, as in a reboot
    planted = image.replace(_pattern(VICTIM), _pattern(PLANTED))
    # Where segments live now nobody else may create a name; where an older daemon
    # kept them, anyone may.
    if seg.parent != SHM:
        assert not _plant_as(attacker, seg, planted), "another user created a segment name"
    legacy = SHM / seg.name
    assert _plant_as(attacker, legacy, planted)
    try:
        _restart_and_replay(daemon)
        assert str(legacy) not in _maps(daemon) and str(seg) not in _maps(daemon)
        assert legacy.stat().st_uid != 0 and not seg.exists()  # not moved in either
        _next_save_elsewhere(daemon)
        # Never pooled: the victim's next save is not readable in the attacker's file.
        assert legacy.read_bytes() == planted
        logged = [line for line in daemon.log_text().splitlines() if str(seg) in line]
        assert logged and "job victim step 1" in logged[0] and "uid" in logged[0], logged
    finally:
        legacy.unlink(missing_ok=True)


def test_a_symlink_under_a_segments_name_is_never_followed(
    make_daemon: Any, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a root daemon following a link is the attack")
    daemon, seg, image = _crash_with_one_handoff(make_daemon)
    seg.unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only\n".ljust(len(image), b"s"))
    secret.chmod(0o600)
    before = secret.read_bytes()
    links = [seg, SHM / seg.name] if seg.parent != SHM else [seg]
    for link in links:
        link.symlink_to(secret)
    try:
        _restart_and_replay(daemon)
        assert str(secret) not in _maps(daemon)
        _next_save_elsewhere(daemon)
        assert secret.read_bytes() == before  # neither read into a step nor overwritten
        logged = [line for line in daemon.log_text().splitlines() if str(seg) in line]
        assert logged and "job victim step 1" in logged[0] and "link" in logged[0], logged
    finally:
        for link in links:
            link.unlink(missing_ok=True)


def test_an_older_daemons_segment_is_moved_in_and_replayed(make_daemon: Any) -> None:
    daemon, seg, _ = _crash_with_one_handoff(make_daemon)
    legacy = SHM / seg.name
    if seg != legacy:
        seg.rename(legacy)  # where a daemon of an earlier release made its segments
    _restart_and_replay(daemon)
    client = daemon.client("victim")
    SaveHandle(client, 1).wait("local", timeout=120)
    # Moved into the daemon's directory (and back in the pool once LOCAL).
    assert not legacy.exists()
    seg_dir = segment_dir(segment_prefix(daemon.root))
    assert seg.name in {p.name for p in seg_dir.iterdir()}
    tree, _ = client.restore(step=1)
    assert tree["w"].tobytes() == _pattern(VICTIM)
    del tree


def _segment_file(path: Path, size: int = SEGMENT_GRANULE, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: _segment_file(p, mode=0o644), "mode is 0644"),
        (lambda p: _segment_file(p, size=3 * SEGMENT_GRANULE), "the journal recorded"),
        (lambda p: os.link(_segment_file(p.with_name("other")), p), "2 hard links"),
        (lambda p: os.symlink(_segment_file(p.with_name("other")), p), "symbolic link"),
        (lambda p: os.mkfifo(p, 0o600), "not a regular file"),
    ],
)
def test_open_trusted_refuses_what_the_daemon_would_not_have_made(
    tmp_path: Path, make: Any, why: str
) -> None:
    make(tmp_path / "seg")
    with pytest.raises(SegmentRefused, match=why):
        open_trusted(tmp_path / "seg", SEGMENT_GRANULE)
    mapping = open_trusted(_segment_file(tmp_path / "good"), SEGMENT_GRANULE)
    assert mapping.size == SEGMENT_GRANULE and mapping.close()


def test_a_segment_directory_the_daemon_does_not_own_stops_the_start(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another uid")
    theirs = tmp_path / "ckptd-x.d"
    theirs.mkdir(0o777)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(Exception, match="remove it"):
        prepare_dir(theirs)
    ours = tmp_path / "ckptd-y.d"
    ours.mkdir(0o755)
    prepare_dir(ours)  # ours but open to others: closed
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
