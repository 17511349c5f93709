"""The registry of remote backends: URL scheme -> class, and what to install for it.

Like fsspec's ``known_implementations``: a backend's module (and its library,
s3fs or gcsfs, which are extras) is imported only when its scheme is used, and
a missing library is one clear error naming the extra to install.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlparse

from .base import Remote
from .errors import RemoteError

BACKENDS: dict[str, dict[str, str]] = {
    "file": {"class": "ckptd.daemon.remote.file.FileRemote", "err": ""},
    "gs": {
        "class": "ckptd.daemon.remote.gcs.GCSRemote",
        "err": "gs:// needs gcsfs: pip install 'ckptd[gcs]'",
    },
    "s3": {
        "class": "ckptd.daemon.remote.s3.S3Remote",
        "err": "s3:// needs s3fs: pip install 'ckptd[s3]'",
    },
}


def open_remote(url: str, endpoint_url: str, part_size: int, concurrency: int) -> Remote:
    """The backend for a remote URL, ready to :meth:`~Remote.check`."""
    scheme = urlparse(url).scheme
    entry = BACKENDS.get(scheme)
    if entry is None:
        raise RemoteError(
            f"unsupported remote URL {url!r}; use s3://, gs:// or file://", transient=False
        )
    module, _, name = entry["class"].rpartition(".")
    try:
        cls: type[Remote] = getattr(importlib.import_module(module), name)
        return cls.open(url, endpoint_url, part_size, concurrency)
    except ImportError as exc:
        raise RemoteError(
            f"{entry['err'] or exc} (import of {exc.name} failed)", transient=False
        ) from None
