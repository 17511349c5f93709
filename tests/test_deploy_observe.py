"""deploy/prometheus and deploy/grafana (issue 16): the alert rules pass promtool's
checks and unit tests, and every metric the rules and the dashboard use is one a
real daemon serves (names cross-checked against a live scrape, not a list)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import Daemon

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "ckptd-dashboard.json"
_NAME = re.compile(r"\bckptd_[a-z0-9_]+")


def promtool() -> str:
    found = Path(sys.executable).with_name("promtool")
    path = str(found) if found.exists() else shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (`make promtool` puts Debian's in .venv/bin)")
    return path


def test_alert_rules_and_scrape_config_pass_promtool() -> None:
    tool = promtool()
    for args in (
        ["check", "rules", "ckptd-alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "ckptd-alerts.test.yml"],
    ):
        out = subprocess.run(
            [tool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


def _exprs() -> list[str]:
    rules = (PROMETHEUS / "ckptd-alerts.yml").read_text()
    exprs = [line.split("expr:", 1)[1] for line in rules.splitlines() if "expr:" in line]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_rules_and_dashboard_use_only_metrics_the_daemon_serves(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon: Daemon = make_daemon(extra_args=["--remote", f"file://{tmp_path / 'bucket'}"])
    client = daemon.client("observed")
    client.save(1, {"w": np.ones(16)}).wait("durable", timeout=120)
    with urllib.request.urlopen(daemon.metrics_url(), timeout=30) as resp:
        text = resp.read().decode()
    served: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            served.add(name)
            if kind == "counter":
                served.add(f"{name}_total")
            if kind == "histogram":
                served.update(f"{name}_{s}" for s in ("bucket", "count", "sum"))
    used = {name for expr in _exprs() for name in _NAME.findall(expr)}
    assert used, "no ckptd metric found in the rules or the dashboard"
    assert used <= served, f"not served by the daemon: {sorted(used - served)}"
    dash = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("exposure", "latency", "drain", "tier", "errors"):
        assert topic in titles, f"the dashboard has no {topic} panel"
