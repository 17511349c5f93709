"""The daemon's logging: one format on stderr, and no credential in any line.

At ``log_level = "debug"`` botocore prints every request it signs (the
``Authorization`` header names the access key id), s3fs and aiobotocore their
call arguments, and google-auth its token refreshes. Those libraries are capped
at WARNING whatever the daemon's level, and every line, tracebacks included, goes
through :func:`ckptd.core.redact.redact` before it is written.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

from ckptd.core.redact import Redactor

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CAPPED = {
    "botocore": logging.WARNING,
    "aiobotocore": logging.WARNING,
    "boto3": logging.WARNING,
    "s3fs": logging.WARNING,
    "fsspec": logging.WARNING,
    "urllib3": logging.WARNING,
    "aiohttp": logging.WARNING,
    "google": logging.WARNING,
    "google_auth_httplib2": logging.WARNING,
    "grpc": logging.WARNING,
    # gcsfs logs every exhausted retry with a traceback; the drain reports those itself.
    "gcsfs": logging.CRITICAL,
}
"""Third-party loggers and the most they may print (they log requests below these)."""


class RedactingFormatter(logging.Formatter):
    """A formatter whose output, traceback included, has every credential masked."""

    def __init__(self, fmt: str, redactor: Redactor) -> None:
        super().__init__(fmt)
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        """The formatted line, redacted."""
        return self.redactor(super().format(record))


def setup(level: str, stream: TextIO | None = None, redactor: Redactor | None = None) -> None:
    """Log at ``level`` to ``stream`` (stderr), capped third-party loggers, redacted."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(RedactingFormatter(FORMAT, redactor or Redactor()))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name, most in CAPPED.items():
        logger = logging.getLogger(name)
        logger.setLevel(max(most, root.level))
    # What would otherwise reach stderr unformatted goes through the handler too.
    logging.captureWarnings(True)
    crash = logging.getLogger("ckptd.crash")
    sys.excepthook = lambda kind, exc, tb: crash.critical("uncaught", exc_info=(kind, exc, tb))
    threading.excepthook = lambda a: crash.critical(
        "uncaught in thread %s",
        a.thread.name if a.thread else "?",
        exc_info=(a.exc_type, a.exc_value, a.exc_traceback),  # type: ignore[arg-type]
    )
