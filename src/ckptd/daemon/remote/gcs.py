"""The ``gs://`` backend (gcsfs): resumable uploads checked against the object's crc32c."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from ckptd.core import checksum

from .base import Remote
from .errors import RemoteError, transient_http_status
from .ranged import RangeSource


class GCSRemote(Remote):
    """``gs://bucket/prefix`` through gcsfs; the object's native crc32c is checked."""

    scheme = "gs"
    rewrite_seconds = 1.0  # "one write per second to the same object name" (GCS quotas)

    async def put_bytes(self, key: str, data: bytes) -> None:
        """A simple upload, then the object's crc32c must match."""
        await self.fs._pipe_file(self.path(key), data)
        want = checksum.value(data)
        got = await self.native_crc32c(key)
        if got != want:
            raise self.mismatch(key, "stored", got or 0, want)

    conditional_writes = True  # ifGenerationMatch preconditions (GCS; fake-gcs-server)

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, obj = self.path(key).partition("/")
        return bucket, obj

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """One media GET: the bytes and their generation (``x-goog-generation``)."""
        bucket, obj = self._bucket_key(key)
        try:
            headers, data = await self.fs._call("GET", "b/{}/o/{}", bucket, obj, alt="media")
        except FileNotFoundError:
            return None
        return bytes(data), str(headers.get("x-goog-generation", ""))

    async def write_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """A multipart upload with ``ifGenerationMatch`` (0: only if absent); GCS refuses
        (412) a write whose generation moved on. The stored crc32c must match."""
        bucket, obj = self._bucket_key(key)
        meta = json.dumps({"name": obj, "crc32c": checksum.to_base64(checksum.value(data))})
        body = (
            (
                f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                "--==0==\nContent-Type: application/octet-stream\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )
        try:
            out = await self.fs._call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                uploadType="multipart",
                ifGenerationMatch=version or "0",
                headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                data=body,
                json_out=True,
            )
        except FileExistsError:  # gcsfs's translation of 412 Precondition Failed
            return None
        stored = out.get("crc32c")
        if stored and checksum.from_base64(stored) != checksum.value(data):
            raise self.mismatch(key, "stored", checksum.from_base64(stored), checksum.value(data))
        return str(out["generation"])

    async def put_file(self, local: Path, key: str, size: int, crc32c: int) -> None:
        """A resumable upload (sequential chunks: GCS has no parallel parts), then check crc32c."""
        await self.fs._put_file(str(local), self.path(key), chunksize=self.part_size)
        got = await self.native_crc32c(key)
        if got != crc32c:
            raise self.mismatch(key, "stored", got or 0, crc32c)

    async def native_crc32c(self, key: str) -> int | None:
        """GCS keeps a crc32c of every object (base64, big-endian)."""
        self.fs.invalidate_cache(self.path(key))
        info = await self.fs._info(self.path(key))
        value = info.get("crc32c")
        return checksum.from_base64(value) if value else None

    async def range_source(self, key: str) -> RangeSource:
        """The object's media link, with the headers (bearer token) gcsfs would send."""
        await self.fs._set_session()
        return RangeSource(self.fs.url(self.path(key)), dict(self.fs._get_headers(None)))

    def _transient(self, exc: BaseException) -> bool:
        """gcsfs raises ``HttpError`` with the response's status in ``code``."""
        return transient_http_status(getattr(exc, "code", ""))

    @classmethod
    def open(cls, url: str, endpoint_url: str, part_size: int, concurrency: int) -> GCSRemote:
        """A ``gs://bucket/prefix`` remote; ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``)
        points it at an emulator."""
        # gcsfs.core's class, not the package's default: that one probes every bucket for
        # the zonal/HNS features over gRPC first (60 s per call against an emulator).
        from gcsfs.core import GCSFileSystem

        kwargs: dict[str, Any] = {"asynchronous": True, "skip_instance_cache": True}
        emulator = endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator:
            kwargs.update(endpoint_url=emulator, token="anon")
        else:  # gcsfs's own search takes ~20 s, then goes on anonymously, retrying
            kwargs.update(token=credentials(os.environ))
        parsed = urlparse(url)
        root = (parsed.netloc + parsed.path).strip("/")
        return cls(url, GCSFileSystem(**kwargs), root, part_size, concurrency)


SCOPE = "https://www.googleapis.com/auth/devstorage.full_control"
METADATA_PROBE_SECONDS = 3.0
"""How long start-up waits for the metadata server (it answers in milliseconds on
GCE and GKE; elsewhere its address leads nowhere and the wait is all it costs)."""
NO_CREDENTIALS = (
    "no Google Cloud credentials found for gs:// (tried GOOGLE_APPLICATION_CREDENTIALS, "
    "the gcloud application-default credentials file {adc}, and the metadata server at "
    "{metadata}); set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, run "
    "`gcloud auth application-default login` as the daemon's user, or run on GCE/GKE with a "
    "service account (Workload Identity)"
)


def credentials(env: Mapping[str, str]) -> Any:
    """google.auth's credentials for the daemon, found in seconds or refused in one
    error naming each source tried. Its chain is followed in its order, but the
    metadata server is asked once, briefly, before google.auth asks it with retries."""
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    explicit = env.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    config_dir = env.get("CLOUDSDK_CONFIG") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".config", "gcloud"
    )
    adc = os.path.join(config_dir, "application_default_credentials.json")
    metadata = env.get("GCE_METADATA_IP") or "169.254.169.254"
    why = NO_CREDENTIALS.format(adc=adc, metadata=metadata)
    # NO_GCE_CHECK: google.auth's own switch to skip the metadata server.
    ask = env.get("NO_GCE_CHECK", "").lower() not in ("1", "true", "yes")
    if not explicit and not os.path.exists(adc) and not (ask and _metadata_answers(metadata)):
        raise RemoteError(why, transient=False)
    try:
        found, _ = google.auth.default(scopes=[SCOPE])
    except DefaultCredentialsError as exc:  # a key file that is missing or malformed
        raise RemoteError(f"{why} (google.auth said: {exc})", transient=False) from None
    return found


def _metadata_answers(address: str) -> bool:
    """Whether a GCE metadata server answers at ``address`` (HOST[:PORT])."""
    request = urllib.request.Request(f"http://{address}/", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_PROBE_SECONDS) as reply:
            return bool(reply.headers.get("Metadata-Flavor") == "Google")
    except (OSError, ValueError):  # refused, unreachable, timed out, not HTTP
        return False
