"""The layering the code promises (docs/architecture.md), checked on the source."""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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
        for p in (REPO / "daemon").rglob("*.py")
        if any(m == "ckptd.client" or m.startswith("ckptd.client.") for m in imports(p))
    ]
    assert offenders == []


def test_core_imports_neither_side() -> None:
    for p in (REPO / "core").rglob("*.py"):
        assert not {m for m in imports(p) if m.startswith(("ckptd.daemon", "ckptd.client"))}, p


def test_no_step_field_is_assigned_outside_the_catalog() -> None:
    pattern = re.compile(rf"\b(st|step|s|old|again|local)\.({STEP_FIELDS})\s*(=|\+=|-=|\|=)[^=]")
    offenders = []
    for p in (REPO / "daemon").rglob("*.py"):
        if p.parent.name == "catalog":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_every_daemon_package_says_what_it_is_and_modules_stay_small() -> None:
    for init in (REPO / "daemon").rglob("__init__.py"):
        doc = ast.get_docstring(parse(init))
        assert doc, f"{init.relative_to(REPO)} has no docstring"
    big = [
        f"{p.relative_to(REPO)} ({n})"
        for root in ("core", "daemon", "client")
        for p in (REPO / root).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    ]
    assert big == []


def test_the_image_copies_every_package_the_wheel_needs() -> None:
    """`docker build` cannot run here: check that the Dockerfile copies each source
    folder pyproject.toml maps to a package (a missing one fails the wheel build)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {d.split("/")[0] for d in project["tool"]["setuptools"]["package-dir"].values()}
    copied = {
        m.group(1)
        for m in re.finditer(r"^COPY (\S+) \./\S+$", (REPO / "Dockerfile").read_text(), re.M)
    }
    assert folders <= copied, f"the Dockerfile does not copy {sorted(folders - copied)}"


def test_every_package_folder_is_in_the_wheel() -> None:
    """A subpackage missing from pyproject's explicit ``packages`` list works in an
    editable install and is silently left out of the wheel."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"pyproject.toml's packages lack {sorted(found - listed)}"
