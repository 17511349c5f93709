"""What mutual TLS costs the peer tier's replica bytes (issue 19).

One data listener (``BulkServer``, in a process of its own, as on a peer) serves a
1 GiB replica file; this process reads it the way a node restoring after a lost disk
does (64 MiB ranges over 4 connections, crc32c of each range) and pushes a 1 GiB
replica to it the way replication does (one connection, 1 MiB pieces; the receiver
checks and writes it). Each arm runs against a listener over plain TCP (the floor:
the same protocol, ``sendfile`` on the serving side) and one over mutual TLS
(``peer_tls_*``: EC P-256 certificates, TLS 1.3), A B A B, ``--reps`` times;
medians. Results: a table on stdout and bench/results/peer_tls.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import google_crc32c
from common import DEFAULT_WORK_DIR, REPO_ROOT, print_table, write_results

from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.peer.bulk import BulkServer
from ckptd.daemon.peer.bulk_client import push, read_range
from ckptd.daemon.peer.replicas import Incoming, ReplicaStore
from ckptd.daemon.peer.tls import PeerTls

sys.path.insert(0, str(REPO_ROOT))  # the tests' certificate maker (the openssl command)
from tests.pki import make_pki

TOKEN = "bench-token-0123456789abcdef0123"
RANGE = 64 * 2**20
THREADS = 4
PIECE = 2**20


def _manifest(step: int, size: int, crc: int, job: str) -> str:
    return Manifest(
        job, step, "src", 1, 1.0, [RankRecord(0, "rank-00000.bin", size, crc, None)]
    ).to_json()


def _tls(pki_dir: Path) -> PeerTls:
    tls = PeerTls.load(
        SimpleNamespace(
            peer_tls_cert_file=str(pki_dir / "node.crt"),
            peer_tls_key_file=str(pki_dir / "node.key"),
            peer_tls_ca_file=str(pki_dir / "ca.crt"),
            peer_tls_server_name="",
        )
    )
    assert tls is not None
    return tls


def serve(store_dir: Path, pki_dir: str) -> None:
    """The listener's process: serve until stdin closes; print the port."""
    store = ReplicaStore(store_dir, 2**40)
    store.load()
    server = BulkServer(store, TOKEN, _tls(Path(pki_dir)) if pki_dir else None)
    print(server.start("127.0.0.1"), flush=True)
    sys.stdin.read()
    server.stop()


def read_all(port: int, size: int, tls: PeerTls | None) -> float:
    """Seconds to read the whole file as the restore's fetch does."""
    buffers = [memoryview(bytearray(PIECE)) for _ in range(THREADS)]

    def one(i: int, offset: int) -> int:
        req = {"job": "get", "source": "src", "step": 5, "file": "rank-00000.bin",
               "offset": offset, "length": min(RANGE, size - offset)}  # fmt: skip
        return read_range(("127.0.0.1", port), TOKEN, req, buffers[i % THREADS], len, tls)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, range(size // RANGE), range(0, size, RANGE)))
    return time.perf_counter() - t0


def push_one(port: int, data: memoryview, step: int, tls: PeerTls | None) -> float:
    """Seconds to push a replica of ``data`` until the receiver holds it."""
    manifest = _manifest(step, len(data), google_crc32c.value(data.obj), "push")

    async def pieces() -> AsyncIterator[memoryview]:
        for at in range(0, len(data), PIECE):
            yield data[at : at + PIECE]

    async def run() -> int:
        request = {"job": "push", "step": step, "manifest": manifest}
        return await push(("127.0.0.1", port), TOKEN, request, pieces, len(data), tls)

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--serve", nargs=2, metavar=("STORE", "PKI"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(Path(args.serve[0]), args.serve[1])
        return 0
    size = args.size_mib * 2**20
    raw = os.urandom(size)
    data, crc = memoryview(raw), google_crc32c.value(raw)
    DEFAULT_WORK_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=DEFAULT_WORK_DIR) as tmp:
        work = Path(tmp)
        pki = make_pki(work / "pki")
        servers: dict[str, tuple[subprocess.Popen[str], int]] = {}
        for arm in ("plain", "tls"):
            store = ReplicaStore(work / arm, 2**40)
            store.load()
            incoming = store.begin("get", 5, _manifest(5, size, crc, "get"))
            assert isinstance(incoming, Incoming)
            for at in range(0, size, PIECE):
                incoming.write(data[at : at + PIECE])
            incoming.finish()
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(work / arm),
                 str(pki.ca.parent) if arm == "tls" else ""],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            servers[arm] = (proc, int(proc.stdout.readline()))
        tls = {"plain": None, "tls": _tls(pki.ca.parent)}
        samples: dict[str, list[float]] = {
            f"{op}_{arm}": [] for op in ("get", "push") for arm in tls
        }
        try:
            read_all(servers["plain"][1], size, None)  # page cache warm for both arms
            read_all(servers["tls"][1], size, tls["tls"])
            for rep in range(args.reps):
                for arm in ("plain", "tls"):  # A B A B
                    port = servers[arm][1]
                    samples[f"get_{arm}"].append(read_all(port, size, tls[arm]))
                    samples[f"push_{arm}"].append(push_one(port, data, 10 + rep, tls[arm]))
        finally:
            for proc, _ in servers.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(30)
    med = {k: statistics.median(v) for k, v in samples.items()}
    gib = size / 2**30
    rows = []
    for op, what in (("get", "restore fetch (4 x 64 MiB ranges)"), ("push", "replica push")):
        plain, tls_s = med[f"{op}_plain"], med[f"{op}_tls"]
        rows.append(
            [
                what,
                f"{plain:.3f} s ({gib / plain:.2f} GiB/s)",
                f"{tls_s:.3f} s ({gib / tls_s:.2f} GiB/s)",
                f"{tls_s / plain:.2f}x",
            ]
        )
    title = f"peer replica bytes, plain vs mutual TLS, medians of {args.reps}"
    print_table(
        [f"{args.size_mib} MiB", "plain TCP (floor)", "mutual TLS", "TLS / plain"],
        rows,
        title=title,
    )
    ratio = {op: med[f"{op}_tls"] / med[f"{op}_plain"] for op in ("get", "push")}
    doc = {"size_bytes": size, "reps": args.reps, "samples_s": samples, "median_s": med,
           "ratio": ratio}  # fmt: skip
    print(f"results: {write_results('peer_tls', doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
