"""ckptd installs beside each framework in one environment: every extra resolves
against what the test environment holds (lightning, transformers, torchtitan, jax
and orbax at the versions pinned in the test extra) with nothing else to install,
and pip finds no broken requirement; `import ckptd.client` pulls in no framework."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ["lightning", "hf", "accelerate", "torchtitan", "maxtext", "megatron", "deepspeed",
          "s3", "gcs", "jax", "torch"]  # fmt: skip


def test_every_extra_resolves_beside_the_frameworks_with_nothing_more(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    # One resolution of every extra together: each alone is a subset of it.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            "-e",
            f"{REPO}[{','.join(EXTRAS)}]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    wanted = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert wanted == ["ckptd"], f"the extras want packages the environment lacks: {wanted}"
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_importing_the_client_imports_no_framework() -> None:
    code = (
        "import sys, ckptd.client, ckptd.client.orbax\n"
        "heavy = {'lightning', 'transformers', 'torchtitan', 'orbax', 'torch', 'jax'}\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
