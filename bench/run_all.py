"""Run every ``bench/bench_*.py`` script in turn with this interpreter (``make bench``).

Each script runs in its own process with its default options and writes
``bench/results/<name>.json``. Exits non-zero if any script fails; the others
still run. ``--only SUBSTR`` runs the scripts whose file name contains SUBSTR.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def scripts(only: str | None = None) -> list[Path]:
    """The benchmark scripts, sorted by name (optionally filtered by a substring)."""
    found = sorted(BENCH_DIR.glob("bench_*.py"))
    return [p for p in found if only is None or only in p.name]


def main(argv: list[str] | None = None) -> int:
    """Run the scripts; returns 0 if all succeeded, 1 otherwise."""
    p = argparse.ArgumentParser(description="Run every bench/bench_*.py script.")
    p.add_argument("--only", help="run only scripts whose file name contains this")
    args = p.parse_args(argv)
    todo = scripts(args.only)
    if not todo:
        print(f"run_all: no bench_*.py scripts in {BENCH_DIR} match", file=sys.stderr)
        return 1
    failed: list[str] = []
    for script in todo:
        print(f"== {script.name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, str(script)], cwd=BENCH_DIR.parent).returncode
        took = time.perf_counter() - t0
        print(f"== {script.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {took:.0f} s")
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"run_all: {len(failed)} of {len(todo)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"run_all: all {len(todo)} benchmarks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
