"""Render deploy/grafana/ckptd-dashboard.json from real data: the README's screenshot.

No Grafana is installable here (not in Debian, not on PyPI), so this runs what it
would show: a real ``ckptd serve`` draining to a real SeaweedFS bucket, a trainer
saving every few seconds, a real Prometheus (Debian's, ``make promtool`` puts it in
.venv/bin) scraping the daemon every second, and then every panel's own PromQL
(read from the dashboard JSON, template variables set to "all") asked of that
Prometheus with ``query_range`` and drawn with matplotlib in the dashboard's
layout. The run has three phases: normal saves, a bucket outage (the S3 server
SIGSTOPped: the bucket's exposure and the drain lag grow while LOCAL keeps up),
and recovery (the drain catches up; a restore is served).

    make dashboard            # .venv/bin/python deploy/grafana/render.py --out ...

The raw query results are written next to the image (``.json``) so the figure can
be checked against them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.servers: the SeaweedFS wrapper the tests use

DASHBOARD = ROOT / "deploy" / "grafana" / "ckptd-dashboard.json"
SCRAPE_SECONDS = 1
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s scrape: 4 scrapes


def _get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def start_prometheus(run: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    """Debian's Prometheus scraping ``target`` (HOST:PORT) every second."""
    from tests.servers import free_port

    binary = Path(sys.executable).with_name("prometheus")
    if not binary.exists():
        sys.exit("render.py: no .venv/bin/prometheus; run `make promtool` first")
    config = run / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_SECONDS}s\n  evaluation_interval: 1s\n"
        # honor_labels: the metrics' own job label (the training job's name) is kept,
        # as deploy/prometheus/prometheus.yml does.
        f"scrape_configs:\n  - job_name: ckptd\n    honor_labels: true\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={run / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(run / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"render.py: prometheus did not start; see {run / 'prometheus.log'}")
            time.sleep(0.2)


def scenario(
    run: Path, phase_seconds: float, state_mib: int
) -> tuple[subprocess.Popen[bytes], str, float, float]:
    """Run the three phases; returns (prometheus, its url, start, end)."""
    from ckptd.client import Client
    from ckptd.daemon.app.launcher import DaemonProcess
    from tests.servers import SeaweedS3

    s3 = SeaweedS3(run / "seaweed").start()
    s3.make_bucket("ckpt")
    daemon = DaemonProcess(
        run / "root",
        run / "ckptd.sock",
        node_id="node-0",
        extra_args=[
            "--remote",
            "s3://ckpt/runs",
            "--part-size-bytes",
            "8MiB",
            "--drain-stall-seconds",
            "5",
            "--drain-retry-max-seconds",
            "2",
        ],
        env=s3.env(),
        log_path=run / "ckptd.log",
    ).start()
    prom, url = start_prometheus(run, daemon.status().metrics_address)
    client = Client("llama-8b", socket=daemon.socket, timeout=600.0)
    rng = np.random.default_rng(0)
    state = {f"layer{i}": rng.standard_normal(state_mib * 2**18 // 8, np.float32) for i in range(8)}
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            step += 10
            for a in state.values():
                a[:1024] += 1.0  # the state changes between steps
            client.save(step, state)
            stop.wait(2.0)  # the "steps" between saves

    start = time.time()
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    time.sleep(phase_seconds)
    s3.pause()  # the bucket stops answering: LOCAL goes on, the drain waits
    time.sleep(phase_seconds)
    s3.resume()
    time.sleep(phase_seconds / 2)
    client.restore()  # served from the local tier
    time.sleep(phase_seconds / 2)
    stop.set()
    trainer.join(60)
    time.sleep(3 * SCRAPE_SECONDS)  # the last samples scraped
    end = time.time()
    client.close()
    daemon.stop()
    s3.close()
    return prom, url, start, end


def query_panels(url: str, start: float, end: float) -> list[dict[str, Any]]:
    """Every panel's targets over [start, end], variables set to match everything."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        series = []
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$__rate_interval", RATE_INTERVAL)
                .replace('"$instance"', '".*"')
                .replace('"$job"', '".*"')
            )
            q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
            got = _get_json(f"{url}/api/v1/query_range?{q}")
            for result in got["data"]["result"]:
                legend = re.sub(
                    r"\{\{\s*(\w+)\s*\}\}",
                    lambda m, labels=result["metric"]: labels.get(m.group(1), ""),
                    target.get("legendFormat") or expr,
                )
                legend = legend.replace(" ()", "")
                points = [(float(t) - start, float(v)) for t, v in result["values"]]
                series.append({"legend": legend, "expr": expr, "points": points})
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        out.append(
            {"title": panel["title"], "grid": panel["gridPos"], "unit": unit, "series": series}
        )
    return out


def _formatter(unit: str) -> Any:
    from matplotlib.ticker import FuncFormatter

    def human(v: float, per: str = "") -> str:
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or u == "TiB":
                return f"{v:.0f} {u}{per}" if u == "B" else f"{v:.1f} {u}{per}"
            v /= 1024
        return f"{v:.1f}"

    if unit == "bytes":
        return FuncFormatter(lambda v, _: human(v))
    if unit == "Bps":
        return FuncFormatter(lambda v, _: human(v, "/s"))
    if unit == "s":
        return FuncFormatter(lambda v, _: f"{v:.0f} s" if v >= 1 or v == 0 else f"{v * 1e3:.0f} ms")
    return FuncFormatter(lambda v, _: f"{v:g}")


def draw(panels: list[dict[str, Any]], out: Path, phase_seconds: float, seconds: float) -> None:
    """The panels at their gridPos (24 columns), Grafana's dark look."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p["grid"]["y"] + p["grid"]["h"] for p in panels)
    fig = plt.figure(figsize=(18, rows * 0.5), facecolor="#111217")
    fig.suptitle(
        "ckptd (deploy/grafana/ckptd-dashboard.json), rendered from a live Prometheus: "
        "saves every 2 s; the bucket stops answering, returns; training stops at the end",
        color="#ccccdc",
        fontsize=11,
    )
    grid = fig.add_gridspec(rows, 24, hspace=3.0, wspace=0.8, top=0.95, bottom=0.04)
    colours = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9"]
    for p in panels:
        g = p["grid"]
        ax = fig.add_subplot(grid[g["y"] : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        ax.set_title(p["title"], color="#ccccdc", fontsize=10, loc="left")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        ax.grid(color="#2c3235", linewidth=0.5)
        ax.set_xlim(0, seconds)
        ax.yaxis.set_major_formatter(_formatter(p["unit"]))
        for edge in (phase_seconds, 2 * phase_seconds):
            ax.axvline(edge, color="#5a5f66", linestyle=":", linewidth=0.8)
        for i, s in enumerate(p["series"]):
            xs = [x for x, _ in s["points"]]
            ys = [y if np.isfinite(y) else np.nan for _, y in s["points"]]
            ax.plot(xs, ys, color=colours[i % len(colours)], linewidth=1.3, label=s["legend"])
        if p["series"]:
            ax.legend(
                fontsize=7, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc",
                edgecolor="#2c3235",
            )  # fmt: skip
        else:
            ax.text(0.5, 0.5, "no data", color="#9fa7b3", ha="center", transform=ax.transAxes)
        ax.set_xlabel("seconds into the run (dotted: bucket stops, bucket returns)",
                      color="#9fa7b3", fontsize=7)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def main() -> int:
    """Run the scenario, query every panel, draw the image and save the data."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    ap.add_argument("--phase-seconds", type=float, default=30.0)
    ap.add_argument("--state-mib", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptd-dash-") as tmp:
        run = Path(tmp)
        prom, url, start, end = scenario(run, args.phase_seconds, args.state_mib)
        try:
            panels = query_panels(url, start, end)
        finally:
            prom.terminate()
            prom.wait(60)
    draw(panels, args.out, args.phase_seconds, end - start)
    args.out.with_suffix(".json").write_text(json.dumps(panels, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
