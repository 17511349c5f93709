"""Code cites documents that are in the repository: every ``*.md`` a source file,
benchmark, manifest or build file names exists, relative to the repository's root
or to the citing file, so a reader following the reference finds it. (Tests are not
scanned: the docs' own tests write pages with made-up names on purpose.)"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ["src", "bench", "deploy", ".ci"]
TOP_FILES = ["Makefile", "Dockerfile", "pyproject.toml"]
SUFFIXES = {".py", ".pyi", ".sh", ".toml", ".yaml", ".yml", ".service", ".md", ".txt", ".cfg"}
SKIPPED_DIRS = {"__pycache__", "results", ".venv"}
"""bench/results holds measured output, not prose that cites."""

CITATION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
URL = re.compile(r"\w+://\S+")


def _scanned_files() -> list[Path]:
    files = [REPO / name for name in TOP_FILES if (REPO / name).exists()]
    for top in SCANNED:
        for p in (REPO / top).rglob("*"):
            parts = set(p.relative_to(REPO).parts)
            if p.is_file() and not parts & SKIPPED_DIRS and p.suffix in SUFFIXES | {""}:
                files.append(p)
    return files


def missing_citations(path: Path, text: str) -> list[str]:
    """``path:line: name`` for each ``*.md`` cited in ``text`` that does not exist."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = URL.sub("", line)  # a web page's README is not the repository's
        for name in CITATION.findall(line):
            if not ((REPO / name).exists() or (path.parent / name).exists()):
                out.append(f"{path.relative_to(REPO)}:{number}: {name}")
    return out


def test_the_check_catches_a_missing_document() -> None:
    here = REPO / "src" / "ckptd" / "x.py"
    text = "see DESIGN.md, and docs/architecture.md; https://example.com/a/README.md"
    assert missing_citations(here, text) == ["src/ckptd/x.py:1: DESIGN.md"]


def test_code_cites_only_documents_in_the_repository() -> None:
    files = _scanned_files()
    assert any(p.name == "commit.py" for p in files)
    missing = [m for p in files for m in missing_citations(p, p.read_text(errors="replace"))]
    assert not missing, "cited documents that are not in the repository:\n" + "\n".join(missing)
