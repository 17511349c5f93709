"""``ckptd --help`` reads as a manual: plain text, sizes in units a user types,
placeholders that say what to type, booleans as flags, options grouped by tier,
and a shell completion script made from the same parser."""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

import pytest

from ckptd.daemon.app import config
from ckptd.daemon.app.cli import build_parser
from ckptd.daemon.app.cli_help import human_size
from ckptd.daemon.local.admission import parse_size

from .conftest import CKPTD


def helps() -> dict[str, str]:
    """Every command's --help text, by command (the top level as "")."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser.format_help(), **{n: p.format_help() for n, p in sub.choices.items()}}


def test_help_is_plain_text_with_real_placeholders() -> None:
    for name, text in helps().items():
        for markup in ("``", ":class:", ":func:", ":meth:", ".py", "VALUE"):
            assert markup not in text, (name, markup)
        for line in text.splitlines():  # argparse's default: the destination upper-cased
            assert not any(w in line for w in (" SOCKET", " CONFIG", " REMOTE_")), (name, line)
    serve = " ".join(helps()["serve"].split())
    assert "--staging-budget-bytes SIZE" in serve and "Default: 4GiB." in serve
    assert "4294967296" not in serve and "68719476736" not in serve
    assert "--remote URL" in serve and "--root PATH" in serve
    assert "--lease-timeout-seconds SECONDS" in serve and "Default: 600." in serve
    assert "--log-level {debug,info,warning,error}" in serve
    assert "--retention-local POLICY" in serve and "Default: KeepLatest(3)." in serve
    assert "--node-claim-takeover, --no-node-claim-takeover" in serve
    # Grouped by tier, in this order.
    titles = ["where and who:", "remote tier (bucket):", "retention:", "peer tier", "metrics:"]
    at = [serve.index(t) for t in titles]
    assert at == sorted(at), at
    assert "other:" not in serve  # every key has its tier's group
    assert "a POLICY is KeepLatest(n)" in serve  # what the policy source file used to say
    assert "pull [-h] [--step STEP] [--node NODE] [--config PATH] [--remote URL]" in " ".join(
        helps()["pull"].split()
    )


@pytest.mark.parametrize("n", [4 * 2**30, 3 * 2**29, 512 * 2**20, 64 * 2**30, 5 * 10**6, 1000])
def test_sizes_are_shown_as_typed_and_read_back(n: int) -> None:
    shown = human_size(n)
    assert parse_size(shown) == n
    assert len(shown) <= 8, shown


def test_booleans_are_flags_in_both_directions() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--node-claim-takeover", "--no-local-evict-unuploaded"])
    flags = {k: getattr(args, k) for k in config.flag_names()}
    assert flags["node_claim_takeover"] is True and flags["local_evict_unuploaded"] is False
    env = {"CKPTD_LOCAL_EVICT_UNUPLOADED": "true"}
    cfg = config.load(None, env, flags)
    assert cfg.node_claim_takeover and not cfg.local_evict_unuploaded  # the flag won
    unset = parser.parse_args(["serve"])
    assert config.load(
        None, env, {k: getattr(unset, k) for k in config.flag_names()}
    ).local_evict_unuploaded
    bad = subprocess.run(
        [CKPTD, "serve", "--node-claim-takeover", "yes"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unrecognized arguments: yes" in bad.stderr


def complete(script: Path, *words: str) -> list[str]:
    """What bash offers after ``words`` (the last one being typed)."""
    line = " ".join(shlex.quote(w) for w in words)
    out = subprocess.run(
        [
            "bash",
            "-c",
            f"source {shlex.quote(str(script))}; COMP_WORDS=({line}); "
            'COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); _ckptd; printf "%s\\n" "${COMPREPLY[@]}"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode in (0, 1) and not out.stderr, out.stderr
    return [w for w in out.stdout.splitlines() if w]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_scripts_cover_every_command(shell: str, tmp_path: Path) -> None:
    out = subprocess.run([CKPTD, "completion", shell], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if shell == "zsh":
        assert out.stdout.startswith("#compdef ckptd\n") and "bashcompinit" in out.stdout
        return
    script = tmp_path / "ckptd.bash"
    script.write_text(out.stdout)
    assert complete(script, "ckptd", "pu") == ["pull"]
    assert "completion" in complete(script, "ckptd", "")
    assert complete(script, "ckptd", "serve", "--staging-b") == ["--staging-budget-bytes"]
    assert complete(script, "ckptd", "serve", "--log-level", "w") == ["warning"]
    assert complete(script, "ckptd", "serve", "--no-node") == ["--no-node-claim-takeover"]
    assert complete(script, "ckptd", "adopt", "j", "1", "/p", "--wait", "") == ["local", "durable"]
    assert complete(script, "ckptd", "completion", "") == ["bash", "zsh"]
    assert complete(script, "ckptd", "serve", "--root", "") == []  # file names: the shell's
