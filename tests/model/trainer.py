"""A trainer process the checker SIGKILLs in the middle of one save.

    python tests/model/trainer.py SOCKET JOB STEP SID FLAVOR VERSIONS POINT MARKER

It saves ``STEP`` of ``JOB`` holding the arrays of ``VERSIONS`` (comma-separated,
trees.py) with metadata ``{"sid": SID}`` and stops at ``POINT`` (the kill points of
tests/faults/trainer.py, plus ``acked``: ``save()`` returned), writing ``MARKER``
when it is there, so the checker kills it at a known place, not after a sleep.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from ckptd.client import Client, FixedInterval
from tests.faults.trainer import KillPoint, emit, instrument
from tests.model.trees import Arrays


def main(argv: list[str]) -> int:
    """Save once, stopping at the kill point."""
    socket, job, step, sid, flavor, versions, point, marker = argv
    stop = KillPoint(point, Path(marker))
    instrument(stop)
    client = Client(job, socket=socket, policy=FixedInterval(1))
    arrays = Arrays(flavor, tuple(int(v) for v in versions.split(",")))
    client.save(int(step), arrays.tree(), metadata={"sid": int(sid)})
    emit("ACK", step)
    stop.at("acked")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
