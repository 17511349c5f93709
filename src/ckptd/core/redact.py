"""Keeping credentials out of logs, error messages and status.

:func:`redact` replaces, in any text the daemon is about to log or send, the values of
credential-bearing environment variables (``AWS_SECRET_ACCESS_KEY``,
``AWS_ACCESS_KEY_ID``, ``*_TOKEN``...), the user-info part of URLs
(``s3://key:secret@...``), signed-URL query parameters (``X-Amz-Signature=...``) and
the key id of an AWS ``Authorization`` header. It is the last line of defence:
third-party loggers that print requests are capped below DEBUG as well
(daemon/app/logs.py), and URLs with credentials are refused by the configuration.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MASK = "***"
SECRET_ENV = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|SESSION|AUTH", re.I)
"""Environment variables whose values are credentials (or name them)."""
MIN_SECRET_CHARS = 6
"""Shorter values (``1``, ``true``) are too common in text to mask."""
_TRIGGER = re.compile(r"[@=]|secret|password|token|access_key", re.I)
_PATTERNS = [
    # scheme://user:password@host -> scheme://***@host
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s@]+@", re.I), rf"\1{MASK}@"),
    # AWS SigV4: Credential=AKIA.../20240101/us-east-1/s3/aws4_request, Signature=...
    (re.compile(r"(Credential=)[^,\s&'\"]+", re.I), rf"\1{MASK}"),
    (re.compile(r"(Signature=)[0-9a-f]+", re.I), rf"\1{MASK}"),
    # Signed URLs and token parameters.
    (
        re.compile(
            r"(\b(?:X-Amz-Credential|X-Amz-Signature|X-Amz-Security-Token|AWSAccessKeyId|"
            r"X-Goog-Credential|X-Goog-Signature|access_token|refresh_token|sig)=)[^&\s'\"]+",
            re.I,
        ),
        rf"\1{MASK}",
    ),
    # key=value and 'key': 'value' in reprs of configs and requests.
    (
        re.compile(
            r"(\b(?:aws_)?(?:secret_access_key|access_key_id|session_token|secret|password|token)"
            r"['\"]?\s*[:=]\s*['\"]?)[^'\"\s,}&]+",
            re.I,
        ),
        rf"\1{MASK}",
    ),
]


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The credential values in ``env`` (default: this process's environment), longest
    first so that a secret containing another is masked whole."""
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if SECRET_ENV.search(k) and len(v) >= MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)


class Redactor:
    """Masks known secret values and credential patterns in text."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        self.secrets = secret_values() if secrets is None else secrets

    def __call__(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        if not text:
            return text
        for value in self.secrets:
            if value in text:
                text = text.replace(value, MASK)
        if _TRIGGER.search(text):  # most lines hold nothing a pattern could match
            for pattern, replacement in _PATTERNS:
                text = pattern.sub(replacement, text)
        return text


_default: Redactor | None = None


def redact(text: str) -> str:
    """:class:`Redactor` over this process's environment, read on first use."""
    global _default
    if _default is None:
        _default = Redactor()
    return _default(text)


def has_credentials(url: str) -> bool:
    """Whether a URL carries credentials (user info, or a signature/token parameter)."""
    return Redactor([])(url) != url
