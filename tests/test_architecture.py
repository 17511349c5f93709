"""The layering the code promises (docs/architecture.md), checked on the source."""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "ckptd"
STEP_FIELDS = (
    "state|error|manifest|remote_nodes|peers|pinned|adopted|busy|read_at|local_at|durable_at"
    "|created_unix|handoff_at|milestone|metrics|node_ranks|world_size"
)


def parse(path: Path) -> ast.Module:
    """``ast.parse`` on a fresh thread: CPython 3.11 (gh-106905) can sometimes
    raise "AST constructor recursion depth mismatch" when the calling thread's
    recursion counter was left off by earlier code (here, other tests)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(ast.parse, path.read_text()).result()


def imports(path: Path) -> set[str]:
    tree = parse(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_daemon_never_imports_the_client() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (SRC / "daemon").rglob("*.py")
        if any(m == "ckptd.client" or m.startswith("ckptd.client.") for m in imports(p))
    ]
    assert offenders == []


def test_core_imports_neither_side() -> None:
    for p in (SRC / "core").rglob("*.py"):
        assert not {m for m in imports(p) if m.startswith(("ckptd.daemon", "ckptd.client"))}, p


def test_no_step_field_is_assigned_outside_the_catalog() -> None:
    pattern = re.compile(rf"\b(st|step|s|old|again|local)\.({STEP_FIELDS})\s*(=|\+=|-=|\|=)[^=]")
    offenders = []
    for p in (SRC / "daemon").rglob("*.py"):
        if p.parent.name == "catalog":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_every_daemon_package_says_what_it_is_and_modules_stay_small() -> None:
    for init in (SRC / "daemon").rglob("__init__.py"):
        doc = ast.get_docstring(parse(init))
        assert doc, f"{init.relative_to(REPO)} has no docstring"
    big = [
        f"{p.relative_to(REPO)} ({n})"
        for root in ("core", "daemon", "client")
        for p in (SRC / root).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    ]
    assert big == []
