"""``ckptd serve``'s options, made from the config: one per key, grouped by tier.

Each option's help is its key's first docstring sentence as plain text (no
reStructuredText, no source paths), its default in the units a user types (sizes
as ``4GiB``, not bytes), the config key and the environment variable. Metavars say
what to type (PATH, SIZE, SECONDS, URL, HOST:PORT...); boolean keys are
``--foo/--no-foo`` flags. Unset options stay ``None`` so the config file and the
environment still apply (config.load merges them).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from . import config as config_mod
from .config_checks import LOG_LEVELS

GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (title, description, keys or key prefixes ending in "_"); the first match wins.
    ("where and who", "the local tier, the socket and this node's name",
     ("root", "socket", "node_id", "log_level")),
    ("saves and the local tier", "shared memory, writers and local disk space",
     ("staging_", "memory_tier_", "lease_", "step_", "write_", "io_", "local_floor",
      "local_low_", "incremental", "incremental_", "supersede_")),
    ("remote tier (bucket)", "where steps are drained to and how",
     ("remote", "remote_", "drain_", "part_size_bytes", "node_claim_")),
    ("retention",
     "which steps each tier keeps; a POLICY is KeepLatest(n), KeepEverySteps(k), "
     "KeepEverySeconds(s), KeepMilestones(), KeepBest('metric', n, mode='min'), "
     "KeepSteps([...]), KeepAll(), or a list of them (a step any of them keeps is kept)",
     ("retention_", "local_evict_", "job_retention", "job_retention_")),
    ("adoption", "finished framework checkpoints handed to the daemon", ("adopt_",)),
    ("access", "who may call the daemon and use which jobs",
     ("socket_group", "allow_", "shared_jobs", "sessions_")),
    ("peer tier (replicas on other nodes)", "replication between the job's daemons",
     ("peer_", "peers")),
    ("metrics", "the HTTP endpoint: /metrics, /healthz, /readyz", ("metrics_",)),
)  # fmt: skip
"""The groups of ``ckptd serve --help``, in order; a key no group names goes to "other"."""

CHOICES = {
    "log_level": LOG_LEVELS,
    "peer_identity": ("auto", "certificate", "address"),
    "metrics_job_labels": ("auto", "on", "off"),
}
"""Keys whose values are a fixed set: the usage lists them, the completion offers them."""

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_size(n: int) -> str:
    """``4GiB``, ``1.5GiB``, ``512MiB``: a size as a user would type it (and
    ``parse_size`` reads back exactly)."""
    for unit, size in _UNITS:
        if n >= size and (n * 10) % size == 0:  # at most one decimal, exact
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return str(n)


def plain(text: str) -> str:
    """Docstring text as help text: ``x`` and :role:`x` markup removed, and
    parentheticals naming a source or doc file (they move; the help stays) dropped."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "")
    text = re.sub(r"\s*\([^()]*\b[\w/.-]+\.(?:py|md)\b[^()]*\)", "", text)
    return " ".join(text.split())


def metavar(key: str, kind: object) -> str:
    """What to type for a key, from its name and type."""
    if key in ("remote", "remote_endpoint_url"):
        return "URL"
    if key.endswith("_address") or key == "peers":
        return "HOST:PORT" + ("[,HOST:PORT...]" if key == "peers" else "")
    if key.endswith("_bytes"):
        return "SIZE"
    if key in ("local_floor", "local_low_watermark"):
        return "SIZE|PCT%"
    if key.endswith("_seconds"):
        return "SECONDS"
    if key.endswith("_file") or kind == "Path":
        return "PATH"
    if kind == "tuple[Path, ...]":
        return "PATH[,PATH...]"
    if kind == "Policy":
        return "POLICY"
    if key == "allow_uids":
        return "USER[,USER...]"
    if key == "allow_gids":
        return "GROUP[,GROUP...]"
    if key == "socket_group":
        return "GROUP"
    if key == "shared_jobs":
        return "PATTERN[,PATTERN...]"
    if key.endswith("_port"):
        return "PORT"
    if key == "staging_share_per_uid":
        return "FRACTION"
    if kind == "int":
        return "N"
    return "NAME"


def default_text(key: str, value: str) -> str:
    """A key's default as a user would type it (``4GiB``, ``600``; "(none)" when empty),
    for ``--help`` and the generated configuration reference."""
    if key.endswith("_bytes") and value.isdigit():
        return human_size(int(value))  # as typed: a per-second key says so in its text
    if value.endswith(".0"):  # 600.0 seconds: typed as 600
        return value[:-2]
    return value or "(none)"


def _group_of(key: str) -> str:
    for title, _, names in GROUPS:
        if any(key == n or (n.endswith("_") and key.startswith(n)) for n in names):
            return title
    return "other"


def add_config_options(p: argparse.ArgumentParser) -> None:
    """One option per config key, in groups, on ``ckptd serve``'s parser."""
    docs, defaults = config_mod.field_docs(), config_mod.default_values()
    kinds = {f.name: f.type for f in dataclasses.fields(config_mod.Config)}
    groups = {t: p.add_argument_group(t, d) for t, d, _ in GROUPS}
    groups["where and who"].add_argument(
        "--config", metavar="PATH", help="TOML config file (or $CKPTD_CONFIG)"
    )
    for key in config_mod.flag_names():
        title = _group_of(key)
        if title not in groups:  # a key no group names yet: listed, never lost
            groups[title] = p.add_argument_group(title)
        group = groups[title]
        choices = CHOICES.get(key)
        text = plain(docs.get(key, ""))
        if key.endswith("_bytes"):
            text += " Sizes take units (512MiB, 4GiB) or plain bytes."
        default = "off" if kinds[key] == "bool" else default_text(key, defaults[key])
        text += f" Default: {default}. Config key {key}, env CKPTD_{key.upper()}."
        flag = f"--{key.replace('_', '-')}"
        text = text.replace("%", "%%")  # argparse formats help with %: "10%" is doubled
        if kinds[key] == "bool":
            group.add_argument(
                flag, dest=key, default=None, help=text, action=argparse.BooleanOptionalAction
            )
        else:
            shown = None if choices else metavar(key, kinds[key])  # None: {a,b,c}
            group.add_argument(
                flag, dest=key, default=None, help=text, metavar=shown, choices=choices
            )


PLACEHOLDERS = {
    "socket": "PATH",
    "config": "PATH",
    "root": "PATH",
    "path": "PATH",
    "dest": "DEST",
    "remote": "URL",
    "remote_endpoint_url": "URL",
    "job": "JOB",
    "user": "USER",
    "step": "STEP",
    "node": "NODE",
    "timeout": "SECONDS",
    "interval": "SECONDS",
    "count": "N",
    "steps": "N",
    "save_every": "N",
}
"""What every other command's values are, by destination (``--socket PATH``)."""


def name_placeholders(parser: argparse.ArgumentParser) -> None:
    """Give each option and argument of every subcommand its placeholder from
    :data:`PLACEHOLDERS` unless it has one (``serve``'s come from the config)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                name_placeholders(sub)
        elif action.metavar is None and action.choices is None and action.nargs != 0:
            action.metavar = PLACEHOLDERS.get(action.dest)
