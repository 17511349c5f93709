"""Where each config value came from: the ``CKPTD_*`` variables that are no setting
(refused: a typo would leave its key at the default without a word), and the line
said when a later source overrides an earlier one's value.

Kept apart from ``config.py`` (the keys, their types and the merge) so each stays
readable; ``config.load`` and ``config.unknown_env`` call these with the keys.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from ckptd.core.redact import redact

from .config_checks import ConfigError

ENV_PREFIX = "CKPTD_"
NOT_KEYS = ("CONFIG", "FAILPOINTS", "FAILPOINT_DIR", "FUZZ_", "INCREMENTAL")
"""``CKPTD_*`` variables that are not config keys but are read elsewhere (the
client's ``CKPTD_SOCKET`` is the ``socket`` key; its ``CKPTD_INCREMENTAL`` none:
a node's environment may give it to the daemon too)."""


def unknown_variables(env: Mapping[str, str], keys: Collection[str]) -> list[str]:
    """One line for each ``CKPTD_*`` variable that is none of ``keys`` (nor one of
    :data:`NOT_KEYS`), with the closest key's variable when there is one."""
    out = []
    for name in sorted(env):
        key = name[len(ENV_PREFIX) :]
        if not name.startswith(ENV_PREFIX) or key.lower() in keys:
            continue
        if any(key == k or (k.endswith("_") and key.startswith(k)) for k in NOT_KEYS):
            continue
        close = difflib.get_close_matches(key.lower(), list(keys), n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
        out.append(f"environment variable {name} is not a ckptd setting{hint}")
    return out


def refuse_unknown(env: Mapping[str, str], keys: Collection[str]) -> None:
    """Raise :class:`ConfigError` (exit 2) naming each ``CKPTD_*`` variable that is
    no setting, and the setting it probably meant."""
    unknown = unknown_variables(env, keys)
    if unknown:
        raise ConfigError(
            "; ".join(unknown) + " (unset or rename it; every key's variable is CKPTD_<KEY>, "
            "listed by ckptd serve --help)"
        )


def shown(value: object) -> str:
    """A raw value as an override line shows it (lists comma-joined, booleans as
    TOML writes them, credentials in a URL masked)."""
    if isinstance(value, bool):
        return str(value).lower()
    return redact(",".join(map(str, value)) if isinstance(value, list) else str(value))


def override_line(key: str, winner: str, loser: str) -> str:
    """``root: environment variable CKPTD_ROOT=/a overrides config file f's /b``."""
    return f"{key}: {winner} overrides {loser}"
