"""Request budget of one job on one bucket, before and after issue 18, from the
stores' published limits (docs/scale.md prints these tables; rerun to check them).

"s: S3" is a step's writes at S3's per-prefix rate, each key range in parallel
once S3 has partitioned it (see :func:`s3_step_seconds`); "s: GCS bucket" all of
them at a new GCS bucket's starting rate (the spread lets GCS scale its ranges,
not start higher).

Per node and step, ckptd writes each rank file (one PUT, or a multipart upload:
create + parts + complete), the node's manifest and marker; since issue 18 also
the node's index, and no longer HEADs each object before (unless an attempt was
cut short) and after (the write's response states the stored checksum), nor lists
open multipart uploads. Steady state evicts one old step per new step.

    python bench/scale/budget.py [--ranks 8] [--gib 1] [--part-mib 16] [--kept 100]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

S3_WRITES_PER_PREFIX = 3500  # PUT/COPY/POST/DELETE per second per partitioned prefix
S3_READS_PER_PREFIX = 5500  # GET/HEAD per second per partitioned prefix
GCS_WRITES_PER_BUCKET = 1000  # object writes per second, initial (doubles per 20 min)
GCS_READS_PER_BUCKET = 5000  # object reads per second incl. listing, initial
LIST_PAGE = 1000  # keys per LIST response (S3 and GCS)
NODES = (1, 100, 1_000, 10_000)


@dataclass(frozen=True)
class Shape:
    """A job: ranks per node, bytes per rank file, part size, steps kept in the bucket."""

    ranks: int = 8
    file_bytes: int = 2**30
    part_bytes: int = 16 * 2**20
    kept: int = 100

    @property
    def parts(self) -> int:
        return max(1, math.ceil(self.file_bytes / self.part_bytes))

    @property
    def file_writes(self) -> int:
        """Requests that write one rank file (multipart: create + parts + complete)."""
        return 1 if self.parts == 1 else self.parts + 2

    def keys_per_node_step(self) -> int:
        """Objects of one node in one step: rank files, manifest, marker."""
        return self.ranks + 2


def per_node_step(s: Shape, after: bool) -> tuple[int, int]:
    """(write-class, read-class) requests one node makes per step, its eviction included."""
    if after:
        writes = s.ranks * s.file_writes + 4  # files, manifest, ranks record, marker, index
        writes += 3  # eviction: index, marker, one DeleteObjects
        reads = 1  # the manifest read back before the marker (a late write is caught)
        reads += 3  # eviction: the pin's HEAD, the node's records and data (2 LISTs)
    else:
        writes = s.ranks * s.file_writes + 2  # files, manifest, marker
        writes += 1 + s.ranks + 1  # eviction: marker, each rank file, manifest
        reads = 2 * s.ranks + 2 * 2  # a HEAD before and after each object
        reads += 1 + 1  # ListMultipartUploads after each step; eviction's LIST
    return writes, reads


SPREAD_RANGES = 256  # <job>/_data/<hh>/: the key ranges the spread layout writes into


def s3_step_seconds(s: Shape, nodes: int, after: bool) -> float:
    """Seconds a step's writes take at S3's per-prefix rate, each key range written in
    parallel once the store has partitioned it. Before: everything under
    ``<job>/<step>/`` (one new range per step). After: the rank files' requests over
    the node ranges of ``<job>/_data/`` (stable, so partitioned once), beside the
    records: manifest and marker under ``<job>/<step>/``, the index (written when a
    step is added and when one is evicted) under ``<job>/_index/``, the evicted step's
    marker under its own ``<job>/<step>/``."""
    w, _ = per_node_step(s, after)
    if not after:
        return w * nodes / S3_WRITES_PER_PREFIX
    data = (s.ranks * s.file_writes + 1) * nodes  # + the eviction's DeleteObjects
    per_range = data / min(SPREAD_RANGES, nodes)
    # Per node: three writes in the step's prefix (manifest, ranks record, marker),
    # two in the index prefix (added, evicted), one in the evicted step's (its marker).
    records = 3 * nodes
    return max(per_range, records) / S3_WRITES_PER_PREFIX


def listing_pages(s: Shape, nodes: int) -> int:
    """LIST requests to list every object of the job (the old start-up and restore)."""
    return max(1, math.ceil(s.kept * nodes * s.keys_per_node_step() / LIST_PAGE))


def restart(s: Shape, nodes: int, after: bool, wiped: bool) -> dict[str, float]:
    """Requests per node when the whole job restarts (daemons too): ``wiped`` every node
    lost its disk (restores from the bucket), else every node holds its newest step."""
    download = s.ranks * s.parts + 1 if wiped else 0  # ranged GETs + the manifest
    puts = 0
    if after:
        lists = 0
        gets = 1 + download  # the node's index (start-up, or the first restore)
        # The node name's claim (daemon/remote/claim.py): read, then one conditional PUT.
        gets, puts = gets + 1, 1
    else:
        # Start-up listed the whole prefix; then every rank's Restore listed the job.
        lists = listing_pages(s, nodes) * (1 + s.ranks)
        gets = download + (s.kept if wiped else 0)  # markers of remote-only steps
    return {"lists": lists, "gets": gets, "puts": puts, "requests": lists + gets + puts}


def table(s: Shape) -> list[list[str]]:
    """Rows of the tables in docs/scale.md."""
    rows = []
    for nodes in NODES:
        for after in (False, True):
            w, r = per_node_step(s, after)
            step_w = w * nodes
            cold = restart(s, nodes, after, wiped=True)
            warm = restart(s, nodes, after, wiped=False)
            rows.append([
                f"{nodes:,}", "after" if after else "before", f"{w}", f"{r}",
                f"{step_w:,}", f"{s3_step_seconds(s, nodes, after):,.1f}",
                f"{step_w / GCS_WRITES_PER_BUCKET:,.1f}",
                f"{warm['requests'] * nodes:,.0f}", f"{cold['requests'] * nodes:,.0f}",
                f"{cold['lists'] * nodes:,.0f}",
                f"{(cold['lists'] + cold['gets']) * nodes / GCS_READS_PER_BUCKET:,.1f}",
            ])  # fmt: skip
    return rows


HEADERS = [
    "nodes", "code", "writes/node/step", "reads/node/step", "writes/step",
    "s: S3", "s: GCS bucket", "restart, disks kept", "restart, disks lost",
    "of which LIST", "s: GCS reads",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print the budget table as Markdown."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per rank file, GiB")
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--kept", type=int, default=100, help="steps of the job in the bucket")
    a = ap.parse_args(argv)
    s = Shape(a.ranks, int(a.gib * 2**30), a.part_mib * 2**20, a.kept)
    print(f"{a.ranks} ranks/node x {a.gib:g} GiB, {a.part_mib} MiB parts, {a.kept} steps kept")
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "---|" * len(HEADERS))
    for row in table(s):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
