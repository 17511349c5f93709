"""Journal replay and /dev/shm: the daemon maps only segment files it made.

An acknowledged save's segment is lost (a reboot-like loss), someone plants a
file under its name, and the daemon restarts and replays the journal. The
planted file must be refused (never mapped, never pooled) and the refusal
logged with job, step, path and reason. A segment that survives a daemon
restart, at the current or at an older daemon's location, is still recovered.
"""

from __future__ import annotations

import contextlib
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
    claim_dir,
    legacy_dir,
    open_trusted,
    recorded_dir,
)
from ckptd.daemon.local.staging import segment_prefix

from .conftest import Daemon
from .helpers import setpriv
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
    seg_dir = recorded_dir(daemon.root)
    assert seg_dir is not None
    # The one acknowledged handoff's segment (beside it, the next save's spare, begun
    # when this save's segment had to be made: local/spares.py).
    victim = _pattern(VICTIM)
    where = [p for p in (*SHM.glob(prefix + "*"), *seg_dir.glob("*")) if victim in p.read_bytes()]
    assert len(where) == 1, where
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
        [*setpriv(user), "/bin/sh", "-c", 'umask 0; cat > "$1"', "sh", str(path)],
        input=data,
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
    assert seg.parent == recorded_dir(daemon.root)
    assert seg.name in {p.name for p in seg.parent.iterdir()}
    tree, _ = client.restore(step=1)
    assert tree["w"].tobytes() == _pattern(VICTIM)
    del tree


def _mkdir_as(user: str, path: Path) -> None:
    """Make the directory ``path`` (mode 0777) as ``user``, as any local user may in
    /dev/shm."""
    subprocess.run([*setpriv(user), "mkdir", "-m", "0777", str(path)], check=True, timeout=60)


def test_a_directory_another_user_made_first_keeps_no_daemon_from_starting(
    make_daemon: Any, tmp_path: Path
) -> None:
    _ensure_users()
    other = USERS[1]
    root = tmp_path / "root"
    # Before the first start: the name earlier releases derived from the root's path.
    squats = [legacy_dir(segment_prefix(root))]
    _mkdir_as(other, squats[0])
    try:
        daemon = make_daemon(root=root)
        client = daemon.client("squatted")
        client.save(1, {"w": np.full(N, VICTIM, np.float32)}).wait("local")
        seg_dir = recorded_dir(root)
        assert seg_dir is not None and seg_dir not in squats
        assert seg_dir.stat().st_uid == os.geteuid()
        assert stat.S_IMODE(seg_dir.stat().st_mode) == 0o700
        # After a clean stop (the directory is removed): the name the root records,
        # made first by the other user, who may have seen it while the daemon ran.
        client.close()
        assert daemon.stop() == 0 and not seg_dir.exists()
        squats.append(seg_dir)
        _mkdir_as(other, seg_dir)
        daemon.restart()
        client = daemon.client("squatted")
        client.save(2, {"w": np.full(N, NEXT, np.float32)}).wait("local")
        tree, _ = client.restore(step=2)
        assert tree["w"].tobytes() == _pattern(NEXT)
        del tree
        fresh = recorded_dir(root)
        assert fresh is not None and fresh not in squats and fresh.stat().st_uid == os.geteuid()
        for squat in squats:  # passed over, never used: nothing of ours in them
            assert squat.stat().st_uid != os.geteuid() and list(squat.iterdir()) == []
    finally:
        for squat in squats:
            with contextlib.suppress(OSError):
                squat.rmdir()


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


def test_a_segment_directory_another_user_owns_is_passed_over(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another uid")
    root = tmp_path / "root"
    root.mkdir()
    record = root / ".shm-dir"
    # Under the name earlier releases derived from the root's path, and under the
    # name the root records: someone else's directory is never used.
    theirs = legacy_dir("ckptd-0123456789ab-", tmp_path)
    theirs.mkdir(0o777)
    os.chown(theirs, 65534, 65534)
    ours = claim_dir(tmp_path, record, theirs)
    assert ours != theirs and recorded_dir(root, tmp_path) == ours
    assert ours.stat().st_uid == os.geteuid() and stat.S_IMODE(ours.stat().st_mode) == 0o700
    assert claim_dir(tmp_path, record, theirs) == ours  # found again (a crashed daemon's)
    ours.rmdir()  # a clean stop removes it; someone takes the recorded name
    ours.mkdir(0o777)
    os.chown(ours, 65534, 65534)
    again = claim_dir(tmp_path, record, theirs)
    assert again not in (ours, theirs) and recorded_dir(root, tmp_path) == again
    os.chmod(again, 0o755)  # ours but open to others: closed when found
    assert claim_dir(tmp_path, record, theirs) == again
    assert stat.S_IMODE(again.stat().st_mode) == 0o700


def test_an_earlier_releases_directory_is_taken_and_recorded(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    legacy = legacy_dir("ckptd-0123456789ab-", tmp_path)
    legacy.mkdir(0o700)  # a crashed daemon of an earlier release left its segments here
    assert claim_dir(tmp_path, root / ".shm-dir", legacy) == legacy
    assert recorded_dir(root, tmp_path) == legacy
    legacy.rmdir()
    fresh = claim_dir(tmp_path, root / ".shm-dir", legacy)
    assert fresh != legacy and fresh.name.startswith("ckptd-") and len(fresh.name) == 40
