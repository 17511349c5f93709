"""``ckptd status`` and ``ckptd status --watch``: the daemon at a glance.

``--watch`` redraws every ``--interval`` seconds what an operator asks first: how
much training a failure now would cost (exposure per job and tier, scraped from the
daemon's own ``/metrics`` so it is the number the alerts use), whether the drain
keeps up (queue, lag, upload rate between two scrapes), restores from the bucket in
progress, staging and free space.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.live import Live
from rich.text import Text

from ckptd.core.wire import Connection
from ckptd.proto import ckptd_pb2 as pb

from .cli_view import console, human_bytes, print_table, show, socket_arg, table

Scrape = dict[str, list[tuple[dict[str, str], float]]]


def plain(msg: Any) -> dict[str, Any]:
    """A message as a JSON-ready dict with real ints and enum names (LOCAL, not 2)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.enum_type is not None:
            prefix = f.enum_type.values[0].name.removesuffix("UNSPECIFIED")
            names = {v.number: v.name.removeprefix(prefix) for v in f.enum_type.values}
            value = [names[v] for v in value] if f.is_repeated else names[value]
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = dict(value)
        elif f.message_type is not None:
            value = [plain(v) for v in value] if f.is_repeated else plain(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _tasks(st: pb.DaemonStatus) -> str:
    """``drain running, evictor restarting (2 restarts: ValueError: ...)``."""
    parts = []
    for t in st.tasks:
        text = f"{t.name} {t.state}"
        if t.restarts or t.last_error:
            text += f" ({t.restarts} restarts" + (f": {t.last_error}" if t.last_error else "") + ")"
        parts.append(text)
    if st.job_errors:
        parts.append(f"{st.job_errors} failed background jobs (see the log)")
    return ", ".join(parts) or "-"


def _memory(st: pb.DaemonStatus) -> str:
    if not st.memory_tier_steps:
        return "off (memory_tier_steps = 0)"
    return (
        f"{human_bytes(st.memory_tier_bytes)} in {st.memory_tier_files} rank files "
        f"(newest {st.memory_tier_steps} per job, at most "
        f"{human_bytes(st.memory_tier_budget_bytes)}); {st.memory_tier_restores} restores, "
        f"{st.memory_tier_evicted} let go"
    )


def _staging(st: pb.DaemonStatus) -> str:
    return (
        f"{human_bytes(st.staging_in_use_bytes)} in use, "
        f"{human_bytes(st.staging_allocated_bytes)} allocated of "
        f"{human_bytes(st.staging_budget_bytes)} budget; "
        f"{st.staging_segments_created} segments created, {st.staging_spares_made} spares"
    )


def _fetching(st: pb.DaemonStatus) -> str:
    if not st.fetch_in_flight_bytes:
        return "-"
    pct = 100.0 * st.fetch_done_bytes / st.fetch_in_flight_bytes
    return (
        f"{human_bytes(st.fetch_done_bytes)} of {human_bytes(st.fetch_in_flight_bytes)} "
        f"({pct:.0f}%)"
    )


def _peer(st: pb.DaemonStatus) -> str:
    """``serving on H:P; 2 peers answered; holds 3 replicas (3.0 GiB); sent 1.0 GiB,
    taken back 0 B; received 3.0 GiB, served 0 B``."""
    if not st.peer_address and not st.peers_known and not st.peer_error:
        return "off"
    return (
        (f"serving on {st.peer_address}" if st.peer_address else "not serving")
        + (f" (data port {st.peer_data_port}); " if st.peer_data_port else "; ")
        + f"{st.peers_known} peers answered; holds {st.replicas_held} replicas "
        + f"({human_bytes(st.replicas_held_bytes)}); sent {human_bytes(st.replicated_bytes)}, "
        + f"taken back {human_bytes(st.peer_fetched_bytes)}; "
        + f"received {human_bytes(st.peer_received_bytes)}, "
        + f"served {human_bytes(st.peer_served_bytes)}"
        + (f"; last error: {st.peer_error}" if st.peer_error else "")
    )


def status_rows(st: pb.DaemonStatus) -> list[list[str]]:
    """The FIELD / VALUE rows of ``ckptd status``."""
    return [
        ["version", f"{st.version} (protocol {st.protocol_version}, pid {st.pid})"],
        ["node", st.node_id],
        ["socket", st.socket],
        ["root", st.root],
        ["remote", st.remote or "(none: local tier only)"],
        ["metrics", f"http://{st.metrics_address}/metrics" if st.metrics_address else "off"],
        ["uptime", f"{st.uptime_seconds:.0f} s"],
        ["checkpoints", f"{st.checkpoints} in {st.jobs} jobs, {human_bytes(st.local_used_bytes)}"],
        ["local free", human_bytes(st.local_free_bytes)],
        ["staging", _staging(st)],
        ["memory tier", _memory(st)],
        ["leases held", str(st.leases_held)],
        [
            "retention",
            f"local {st.retention_local}"
            + (f"; remote {st.retention_remote}" if st.retention_remote else ""),
        ],
        [
            "free-space marks",
            f"evict below {human_bytes(st.local_low_watermark_bytes)}, refuse saves below "
            f"{human_bytes(st.local_floor_bytes)}",
        ],
        ["evicted", f"{st.evicted_local} local, {st.evicted_remote} remote copies"],
        ["adopted", f"{st.adopted} steps; {st.watched_directories} watched directories"],
        ["saves in flight", str(st.saves_in_flight)],
        [
            "drain",
            (f"{st.drain_queue} steps queued" if st.remote else "-")
            + (f"; last error: {st.drain_error}" if st.drain_error else ""),
        ],
        ["bucket fetches", _fetching(st)],
        ["peer tier", _peer(st)],
        ["background", _tasks(st)],
    ]


def scrape(address: str, timeout: float = 10.0) -> Scrape:
    """The daemon's /metrics as ``{name: [(labels, value), ...]}`` (counters under
    their ``_total`` names); empty when metrics are off or do not answer."""
    if not address:
        return {}
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"  # served on every interface: this one is among them
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _value(s: Scrape, name: str, **labels: str) -> float:
    return sum(v for lab, v in s.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def watch_view(st: pb.DaemonStatus, now: Scrape, before: Scrape | None, dt: float) -> Group:
    """One frame of ``ckptd status --watch``: exposure per job, then the daemon's
    queues and resources."""
    tty = console().is_terminal
    exposure: dict[str, dict[str, float]] = {}
    for labels, value in now.get("ckptd_exposure_seconds", []):
        # No job label: metrics_job_labels is off, the series is the node's worst job.
        job = labels.get("job", "(worst job)")
        exposure.setdefault(job, {})[labels["tier"]] = value
    jobs = [
        [job, _duration(t["local"]) if "local" in t else "-"]
        + ([_duration(t["remote"]) if "remote" in t else "-"] if st.remote else [])
        for job, t in sorted(exposure.items())
    ]
    headers = ["JOB", "EXPOSURE LOCAL"] + (["EXPOSURE BUCKET"] if st.remote else [])
    upload = "-"
    if before is not None and dt > 0:
        sent = _value(now, "ckptd_bytes_total", stage="upload")
        sent -= _value(before, "ckptd_bytes_total", stage="upload")
        upload = f"{human_bytes(max(sent, 0.0) / dt)}/s"
    rows = [
        ["saves in flight", str(st.saves_in_flight)],
        [
            "drain",
            f"{st.drain_queue} steps queued, lag "
            f"{_duration(_value(now, 'ckptd_drain_lag_seconds'))}, upload {upload}"
            if st.remote
            else "- (no bucket configured)",
        ],
        ["bucket fetches", _fetching(st)],
        ["peer tier", _peer(st)],
        ["staging", _staging(st)],
        ["memory tier", _memory(st)],
        ["local free", human_bytes(st.local_free_bytes)],
        ["background", _tasks(st)],
    ]
    stamp = time.strftime("%H:%M:%S")
    head = Text(f"ckptd {st.node_id}  {stamp}  (exposure: training a failure now would cost)")
    if not now:
        head.append("\nno metrics from the daemon (metrics_address off?): exposure unknown")
    parts: list[Any] = [head]
    if jobs:
        parts.append(table(headers, jobs, tty=tty))
    elif now:
        parts.append(Text("no complete checkpoint yet"))
    parts.append(table(["FIELD", "VALUE"], rows, tty=tty))
    return Group(*parts)


def watch(
    conn: Connection,
    interval: float,
    count: int | None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraw the watch view every ``interval`` seconds, ``count`` times (None: until
    interrupted). Piped, each frame is printed after the last, blank-line separated."""
    out = console()
    before: Scrape | None = None
    at = 0.0
    frames = 0
    live = Live(console=out, auto_refresh=False) if out.is_terminal else None
    if live is not None:
        live.start()
    try:
        while count is None or frames < count:
            if frames:
                sleep(interval)
            st = conn.get_status(pb.GetStatusRequest())
            now, t = scrape(st.metrics_address), time.monotonic()
            view = watch_view(st, now, before, t - at)
            if live is not None:
                live.update(view, refresh=True)
            else:
                if frames:
                    out.file.write("\n")
                show(view, out)
            before, at = now, t
            frames += 1
    finally:
        if live is not None:
            live.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``ckptd status [--json] [--watch [--interval S] [--count N]]``."""
    conn = Connection(args.socket, timeout=30.0)
    if args.watch:
        return watch(conn, args.interval, args.count)
    st = conn.get_status(pb.GetStatusRequest())
    if args.json:
        print(json.dumps(plain(st), indent=1))
        return 0
    print_table(["FIELD", "VALUE"], status_rows(st))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``status`` on the main parser."""
    p = sub.add_parser("status", help="daemon health and resource use")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--watch",
        action="store_true",
        help="redraw exposure per job and tier, drain queue, lag and upload rate, bucket "
        "fetches, staging and free space until interrupted",
    )
    p.add_argument(
        "--interval", type=float, default=2.0, help="seconds between redraws (default: 2)"
    )
    p.add_argument(
        "--count", type=int, default=None, help="stop after this many redraws (default: never)"
    )
    socket_arg(p)
    p.set_defaults(fn=cmd_status)
