"""The README and the docs site stay true to the code: the generated reference pages
match what the code generates now, every config key is documented, every relative
link leads to a file (and heading) that exists, and the README's quickstart runs as
printed against a real daemon."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .conftest import Daemon

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _gen_reference() -> ModuleType:
    """docs/gen_reference.py, imported by path (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_match_the_code() -> None:
    for path, text in _gen_reference().pages().items():
        assert path.exists(), f"{path} is missing: run python docs/gen_reference.py"
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)} differs from what the code generates "
            "(a config key or a metric changed): run python docs/gen_reference.py"
        )


def test_every_config_key_and_metric_is_in_its_reference() -> None:
    from ckptd.daemon.app.config import Config

    gen = _gen_reference()
    config_page = gen.configuration_page()
    for f in dataclasses.fields(Config):
        assert f"| `{f.name}` |" in config_page, f.name
    metrics_page = gen.metrics_page()
    for name in ("ckptd_exposure_seconds", "ckptd_saves_total", "ckptd_peer_bytes_total"):
        assert f"| `{name}` |" in metrics_page, name


def test_a_config_key_without_a_docstring_fails_the_reference() -> None:
    @dataclasses.dataclass
    class Settings:
        documented: int = 1
        """What it does."""
        forgotten: int = 2
        also_documented: str = ""
        """What this one does."""

    gen = _gen_reference()
    with pytest.raises(gen.Undocumented, match="forgotten") as info:
        gen.field_texts(Settings)
    assert "documented," not in str(info.value)


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(title: str) -> str:
    """A heading's anchor as Python-Markdown's toc extension makes it (mkdocs)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize(
    "page",
    [REPO / "README.md", *sorted(DOCS.rglob("*.md"))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_relative_links_resolve(page: Path) -> None:
    assert _broken_links(page) == [], f"broken links in {page.relative_to(REPO)}"


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A title\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-title) [gone](missing.md) [anchor](other.md#nope)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#nope: no heading with that anchor",
    ]


def _block(page: Path, marker: str) -> str:
    text = page.read_text()
    assert f"<!-- {marker} -->\n```" in text, f"no <!-- {marker} --> block in {page}"
    return text.split(f"<!-- {marker} -->\n```", 1)[1].split("\n", 1)[1].split("```", 1)[0]


def test_getting_started_shows_the_readme_quickstart() -> None:
    page = DOCS / "getting-started.md"
    for marker in ("quickstart-shell", "quickstart"):
        assert _block(page, marker) == _block(REPO / "README.md", marker)


def test_readme_quickstart_serve_flags_exist() -> None:
    shell = _block(REPO / "README.md", "quickstart-shell")
    flags = re.findall(r"(--[a-z-]+)", shell.split("ckptd serve", 1)[1].split("\n", 1)[0])
    assert flags, shell
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in flags:
        assert flag in proc.stdout, f"ckptd serve has no {flag}"


def test_readme_quickstart_runs_as_printed(make_daemon: Any, tmp_path: Path) -> None:
    d: Daemon = make_daemon()
    script = tmp_path / "quickstart.py"
    script.write_text(_block(REPO / "README.md", "quickstart") + "\nprint('restored', meta)\n")
    env = {**os.environ, "CKPTD_SOCKET": str(d.socket)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "restored" in proc.stdout
    assert d.client("quickstart").latest_step() == 100


def test_docs_cited_by_the_code_exist() -> None:
    cited = {
        (m, p.relative_to(REPO))
        for p in (REPO / "src").rglob("*.py")
        for m in re.findall(r"\bdocs/[\w/.-]+?\.md\b", p.read_text())
    }
    assert cited, "the code cites no docs page: the pattern is wrong"
    missing = sorted(f"{path} cites {doc}" for doc, path in cited if not (REPO / doc).exists())
    assert missing == []
