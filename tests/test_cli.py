"""The ckptd command line against a real daemon: tables, --json, clear errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .conftest import CKPTD, Daemon


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPTD, *args], capture_output=True, text=True, timeout=120)


def test_ls_and_status_tables_and_json(daemon: Daemon) -> None:
    c = daemon.client("cli-job")
    c.save(10, {"w": np.zeros(1000, np.float32)}, milestone=True).wait("local")
    c.save(20, {"w": np.ones(1000, np.float32)}).wait("local")
    out = run("ls", "--socket", str(daemon.socket))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["JOB", "STEP", "STATE", "TIERS"]
    assert lines[1].split()[:4] == ["cli-job", "20", "LOCAL", "memory,local"]
    assert "milestone" in lines[2]
    js = json.loads(run("ls", "cli-job", "--json", "--socket", str(daemon.socket)).stdout)
    assert [(r["step"], r["state"], r["tiers"]) for r in js] == [
        (20, "LOCAL", ["MEMORY", "LOCAL"]),
        (10, "LOCAL", ["LOCAL"]),
    ]
    assert js[1]["milestone"] is True and js[0]["size_bytes"] > 4000
    st = run("status", "--socket", str(daemon.socket))
    assert st.returncode == 0 and "test-node" in st.stdout and "2 in 1 jobs" in st.stdout
    assert "memory tier" in st.stdout and "in 1 rank files (newest 1 per job" in st.stdout
    sj = json.loads(run("status", "--json", "--socket", str(daemon.socket)).stdout)
    assert sj["node_id"] == "test-node" and sj["checkpoints"] == 2 and sj["protocol_version"] == 1


def test_ls_empty_job(daemon: Daemon) -> None:
    out = run("ls", "nothing-here", "--socket", str(daemon.socket))
    assert out.returncode == 0 and "no checkpoints for job 'nothing-here'" in out.stdout


def test_unreachable_socket_is_one_clear_line(tmp_path: Path) -> None:
    out = run("status", "--socket", str(tmp_path / "missing.sock"))
    assert out.returncode == 2
    assert out.stderr.startswith("ckptd: error: cannot reach the ckptd daemon")
    assert "Traceback" not in out.stderr


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text('root = "/tmp/x"\nstaging_budgt_bytes = "1GiB"\n')
    out = run("serve", "--config", str(cfg))
    assert out.returncode == 2
    assert "unknown config key 'staging_budgt_bytes'" in out.stderr
    assert "did you mean 'staging_budget_bytes'" in out.stderr and "Traceback" not in out.stderr
    out = run(
        "serve",
        "--root",
        str(tmp_path / "r"),
        "--socket",
        str(tmp_path / "s.sock"),
        "--write-workers",
        "many",
    )
    assert out.returncode == 2 and "flag --write-workers" in out.stderr


@pytest.mark.slow  # three trainer processes and a daemon
def test_demo_runs_end_to_end() -> None:
    out = run("demo", "--steps", "20", "--save-every", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILLed" in out.stdout and "IDENTICAL" in out.stdout
    assert "resumed from step 11" in out.stdout


def test_version_flag_help_and_unknown_environment_variables() -> None:
    from ckptd.daemon import __version__
    from ckptd.daemon.app import config

    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ckptd {__version__}"
    helptext = " ".join(run("serve", "--help").stdout.split())
    # Every flag says what it means, its default and where else it can be set.
    assert "Local tier directory (on NVMe). Default: /var/lib/ckptd." in helptext
    assert "Default: 10%" in helptext
    assert helptext.count("Config key ") == len(config.flag_names())
    warnings = config.unknown_env(
        {"CKPTD_STAGING_BUDGET": "1GiB", "CKPTD_ROOT": "/x", "CKPTD_FAILPOINTS": "", "HOME": "/"}
    )
    assert warnings == [
        "environment variable CKPTD_STAGING_BUDGET is not a ckptd setting; "
        "did you mean CKPTD_STAGING_BUDGET_BYTES?"
    ]
