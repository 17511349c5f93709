"""Typed, validated daemon configuration: embedded defaults < file < ``CKPTD_*`` env < flags.

Every error names the offending key and its source, and says what is accepted.
Values are never silently rewritten: a bad value stops start-up. Retention
policies and free-space marks are parsed here, once, into typed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import os
import pwd
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..local.admission import SpaceMark, parse_size
from ..retention.policies import Policy, PolicyError, parse_policy
from .config_checks import ConfigError as ConfigError  # re-exported: callers import it from here
from .config_checks import validate
from .config_fields import DEFAULT_METRICS_ADDRESS as DEFAULT_METRICS_ADDRESS
from .config_fields import DEFAULT_ROOT as DEFAULT_ROOT
from .config_fields import Config as Config  # re-exported: callers import it from here
from .config_sources import ENV_PREFIX as ENV_PREFIX  # re-exported: the CLI reads it here
from .config_sources import override_line, refuse_unknown, shown, unknown_variables

_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _items(value: object) -> list[str]:
    """A TOML array, or a comma-separated string (environment, flags)."""
    raw = value if isinstance(value, list | tuple) else str(value).split(",")
    return [str(v).strip() for v in raw if str(v).strip()]


def _principal(text: str, kind: str) -> int:
    """A uid or gid given as a number or a name."""
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid if kind == "user" else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no {kind} named {text!r} on this host") from None


def _coerce(key: str, value: object, source: str) -> Any:
    kind = _FIELDS[key].type
    try:
        if kind == "tuple[Path, ...]":
            paths = [Path(v).expanduser() for v in _items(value)]
            if not all(p.is_absolute() for p in paths):
                raise ValueError("expected absolute paths")
            return tuple(Path(os.path.realpath(p)) for p in paths)
        if kind == "tuple[int, ...]":
            who = "user" if key.endswith("uids") else "group"
            return tuple(_principal(v, who) for v in _items(value))
        if kind == "tuple[str, ...]":
            return tuple(_items(value))
        if key == "socket_group" and str(value):
            return str(_principal(str(value), "group"))
        if kind == "Path":
            if not str(value):
                raise ValueError("expected a path, got an empty string")
            return Path(str(value)).expanduser()
        if kind == "Policy":
            try:
                return parse_policy(str(value))
            except PolicyError as exc:
                raise ValueError(str(exc)) from None
        if kind == "SpaceMark":
            return SpaceMark.parse(value)
        if key.endswith("_bytes"):
            size = parse_size(value)
            if key == "memory_tier_bytes" and size == 0:  # 0: the staging budget
                return 0
            if size <= 0:
                raise ValueError("must be positive")
            return size
        if kind == "bool":
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("expected true or false")
            return text in ("true", "1", "yes")
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError("expected an integer, got a boolean")
            n = int(str(value))
            if key == "io_nice":  # 0 is meaningful here (no change); the range is checked later
                if n < 0:
                    raise ValueError("must be 0 (no change) to 19 (lowest)")
                return n
            if key == "incremental_max_files" and n < 2:
                raise ValueError("must be at least 2 (the step's own file and one other)")
            if key == "incremental_full_every":  # 0: never by count
                if n < 0:
                    raise ValueError("must be 0 (never by count) or a number of saves")
                return n
            if key == "memory_tier_steps":  # 0: the memory tier is off
                if n < 0:
                    raise ValueError("must be 0 (no memory tier) or a number of steps")
                return n
            if key == "peer_data_port":  # 0: any free port, -1: none
                if not -1 <= n <= 65535:
                    raise ValueError("must be a TCP port, 0 (any free port) or -1 (none)")
                return n
            if n <= 0:
                raise ValueError("must be a positive integer")
            return n
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number, got a boolean")
            x = float(str(value))
            if key == "remote_read_jitter_seconds":  # 0: no jitter
                if not 0 <= x <= 600:
                    raise ValueError("must be 0 (no jitter) to 600 seconds")
                return x
            if key == "staging_share_per_uid" and not 0 < x <= 1:
                raise ValueError("use a fraction of staging_budget_bytes above 0 and at most 1")
            if not x > 0:
                raise ValueError("must be a positive number of seconds")
            return x
        return str(value)
    except ValueError as exc:
        raise ConfigError(f"invalid value for {key!r} from {source}: {exc}") from None


def _check_key(key: str, source: str) -> None:
    if key not in _FIELDS:
        close = difflib.get_close_matches(key, list(_FIELDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown config key {key!r} in {source}{hint} (valid keys: {', '.join(_FIELDS)})"
        )


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into raw key/value pairs."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None


def load(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """Merge the sources (later wins) and validate the result.

    ``overrides``, when given, receives one line per value a later source replaced
    with a different one (:func:`override_line`): the Dockerfile's or a unit's
    ``CKPTD_ROOT`` beating the operator's config file must not go unsaid."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> "<source> <raw value>" of the value in force
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(env[ENV_PREFIX + "CONFIG"])

    def put(key: str, value: Any, source: str, shown: str) -> None:
        coerced = _coerce(key, value, source)
        if overrides is not None and key in given and values[key] != coerced:
            overrides.append(override_line(key, shown, given[key]))
        values[key], given[key] = coerced, shown

    if config_file is not None:
        source = f"config file {config_file}"
        for key, value in load_file(config_file).items():
            _check_key(key, source)
            put(key, value, source, f"config file {config_file}'s {shown(value)}")
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in _FIELDS:
            source = f"environment variable {name}"
            put(key, value, source, f"{source}={shown(value)}")
    for key, value in (flags or {}).items():
        if value is not None:
            _check_key(key, "flags")
            flag = f"flag --{key.replace('_', '-')}"
            put(key, value, flag, f"{flag}={shown(value)}")
    cfg = Config(**values)
    validate(cfg)
    return cfg


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``CKPTD_*`` variable that is no config key (a typo would
    otherwise be silently ignored), with the closest key when there is one."""
    return unknown_variables(os.environ if env is None else env, _FIELDS)


def refuse_unknown_env(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` (exit 2) if a ``CKPTD_*`` variable is no setting."""
    refuse_unknown(os.environ if env is None else env, _FIELDS)


def field_texts(cls: type = Config) -> dict[str, str]:
    """Each field of the dataclass ``cls`` (its own and its bases', as for
    :class:`Config`, whose keys its option groups declare) with its whole docstring
    (the string literal right after it), whitespace folded; "" for one without."""
    texts: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if "__dataclass_fields__" in vars(base):
            texts.update(_own_field_texts(base))
    return texts


def _own_field_texts(cls: type) -> dict[str, str]:
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    texts: dict[str, str] = {}
    for node, after in zip(body.body, [*body.body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                doc = " ".join(after.value.value.split())
            texts[node.target.id] = doc
    return texts


def field_docs() -> dict[str, str]:
    """Each key's help: the first sentence of its docstring in :class:`Config`."""
    return {k: t.split(". ")[0].rstrip(".") + "." for k, t in field_texts().items() if t}


def default_values() -> dict[str, str]:
    """Each key's built-in default as text (for ``--help``)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(Config):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if isinstance(value, Policy):
            value = value.describe()
        elif isinstance(value, SpaceMark):
            value = value.text
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        out[f.name] = str(value) if f.name != "node_id" else "the host name"
    return out


def flag_names() -> list[str]:
    """Config keys that ``ckptd serve`` exposes as ``--flags``."""
    return list(_FIELDS)
