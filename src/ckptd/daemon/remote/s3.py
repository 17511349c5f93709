"""S3 backend (s3fs): parallel multipart uploads with per-part CRC32C checksums."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ckptd.core import checksum

from ..io import gather_all, in_thread
from .base import Remote, read_part
from .buffers import parts
from .errors import RemoteError, transient_http_status
from .ranged import RangeSource

log = logging.getLogger("ckptd.remote")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "RequestTimeTooSkewed",
        "BadDigest",
        "InvalidDigest",
    }
)
PRESIGN_SECONDS = 3600
"""Lifetime of a presigned download URL (a download re-signs after ranged.py's max age)."""
MAX_PARTS = 10_000
"""S3's most parts in one multipart upload."""
META_CRC = "ckptd-crc32c"
"""User metadata holding the whole object's crc32c (multipart objects only have a composite)."""


def s3_filesystem(endpoint_url: str) -> Any:
    """An async s3fs filesystem; credentials and region from the standard AWS chain."""
    import s3fs

    kwargs: dict[str, Any] = {
        "asynchronous": True,
        "skip_instance_cache": True,
        # Retries are the drain's job (with backoff it controls); keep botocore's short.
        "config_kwargs": {
            "retries": {"max_attempts": 2, "mode": "standard"},
            "connect_timeout": 10,
            "read_timeout": 120,
            # Integrity comes from the CRC32C sent with every request; hashing each part
            # again with SHA-256 for the signature (what botocore does over plain HTTP)
            # would cost a third of the drain's CPU on the daemon's event loop.
            "s3": {"payload_signing_enabled": False},
        },
    }
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    return s3fs.S3FileSystem(**kwargs)


def _read_body(path: Path, offset: int, length: int, buf: Any) -> tuple[bytes, int]:
    """A part as the ``bytes`` botocore wants, made on a worker thread, and its crc32c."""
    n, part_crc = read_part(path, offset, length, buf)
    return bytes(memoryview(buf)[:n]), part_crc


class S3Remote(Remote):
    """``s3://bucket/prefix``; works with AWS S3 and S3-compatible stores."""

    scheme = "s3"

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, obj = self.path(key).partition("/")
        return bucket, obj

    @classmethod
    def open(cls, url: str, endpoint_url: str, part_size: int, concurrency: int) -> S3Remote:
        """An ``s3://bucket/prefix`` remote (``endpoint_url``: an S3-compatible store)."""
        parsed = urlparse(url)
        root = (parsed.netloc + parsed.path).strip("/")
        return cls(url, s3_filesystem(endpoint_url), root, part_size, concurrency)

    def _transient(self, exc: BaseException) -> bool:
        """botocore's error codes (SlowDown, InternalError, ...) and HTTP statuses."""
        response = getattr(exc, "response", None)
        code = ""
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
        code = code or str(getattr(exc, "code", "") or "")
        return code in _TRANSIENT_CODES or transient_http_status(code)

    async def _s3(self, method: str, **kwargs: Any) -> Any:
        return await self.fs._call_s3(method, **kwargs)

    async def _put_object(self, key: str, data: bytes, value: int, **extra: Any) -> Any:
        """One PutObject carrying ``data``'s CRC32C ``value``, which the store verifies."""
        bucket, obj = self._bucket_key(key)
        return await self._s3(
            "put_object",
            Bucket=bucket,
            Key=obj,
            Body=data,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=checksum.to_base64(value),
            **extra,
        )

    async def put_bytes(self, key: str, data: bytes) -> None:
        """One PutObject; the store verifies the CRC32C sent with it."""
        value = checksum.value(data)
        out = await self._put_object(key, data, value, Metadata={META_CRC: str(value)})
        await self._verify_stored(key, value, [value], out)

    conditional_writes = True  # If-None-Match / If-Match on PutObject (AWS; SeaweedFS)

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """One GetObject: the bytes and their ETag (what ``If-Match`` compares)."""
        bucket, obj = self._bucket_key(key)
        try:
            resp = await self._s3("get_object", Bucket=bucket, Key=obj)
        except Exception as exc:
            if _missing(exc):
                return None
            raise
        body = resp["Body"]
        try:
            data: bytes = await body.read()
        finally:
            body.close()
        return data, str(resp["ETag"])

    async def write_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """A conditional PutObject: ``If-None-Match: *`` to create, ``If-Match: <etag>``
        to replace; the store refuses (412) a write whose condition no longer holds."""
        cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            out = await self._put_object(key, data, checksum.value(data), **cond)
        except Exception as exc:
            if _precondition_failed(exc):
                return None
            raise
        return str(out["ETag"])

    async def put_file(self, local: Path, key: str, size: int, crc32c: int) -> None:
        """Parts read with O_DIRECT, uploaded in parallel, each with its CRC32C.

        The parts' checksums, combined, must equal the commit-time crc32c before the
        upload is completed; otherwise it is aborted and the step retried.
        """
        bucket, obj = self._bucket_key(key)
        pieces = parts(size, self.part_size)
        if len(pieces) > MAX_PARTS:
            need = -(-size // MAX_PARTS)
            raise RemoteError(
                f"{local.name} is {size / 2**30:.1f} GiB: more than S3's {MAX_PARTS:,} parts of "
                f"part_size_bytes={self.part_size}; set part_size_bytes to at least {need} "
                "(docs/scale.md)",
                transient=False,
            )
        if len(pieces) == 1:
            async with self.buffers.buffer() as buf:
                body, part_crc = await in_thread(_read_body, local, 0, size, buf)
            if part_crc != crc32c:
                raise self.mismatch(key, "read back", part_crc, crc32c)
            await self.put_bytes(key, body)
            return
        mpu = await self._s3(
            "create_multipart_upload",
            Bucket=bucket,
            Key=obj,
            ChecksumAlgorithm="CRC32C",
            # FULL_OBJECT: the store's checksum is the plain crc32c of the whole object,
            # comparable with the commit-time value (not a crc of the parts' crcs).
            ChecksumType="FULL_OBJECT",
            Metadata={META_CRC: str(crc32c)},
        )
        upload_id = mpu["UploadId"]
        try:

            async def one(number: int, offset: int, length: int) -> tuple[dict[str, Any], int]:
                # The slot is held from the read to the end of the upload, so at most
                # drain_concurrency parts are in memory whatever the checkpoint's size.
                async with self._limit, self.buffers.buffer() as buf:
                    body, part_crc = await in_thread(_read_body, local, offset, length, buf)
                    out = await self._s3(
                        "upload_part",
                        Bucket=bucket,
                        Key=obj,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=body,
                        ChecksumAlgorithm="CRC32C",
                        ChecksumCRC32C=checksum.to_base64(part_crc),
                    )
                    del body
                return {
                    "PartNumber": number,
                    "ETag": out["ETag"],
                    "ChecksumCRC32C": checksum.to_base64(part_crc),
                }, part_crc

            done = await gather_all(*(one(i + 1, o, n) for i, (o, n) in enumerate(pieces)))
            part_crcs = [c for _, c in done]
            whole = checksum.combine_all(
                [(c, n) for c, (_, n) in zip(part_crcs, pieces, strict=True)]
            )
            if whole != crc32c:
                raise self.mismatch(key, "uploaded", whole, crc32c)
            out = await self._s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=obj,
                UploadId=upload_id,
                MultipartUpload={"Parts": [p for p, _ in done]},
                ChecksumType="FULL_OBJECT",
                ChecksumCRC32C=checksum.to_base64(crc32c),
            )
        except BaseException:
            await asyncio.shield(self._abort(bucket, obj, upload_id))
            raise
        await self._verify_stored(key, crc32c, part_crcs, out)

    async def _abort(self, bucket: str, obj: str, upload_id: str) -> None:
        try:
            await self._s3("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id)
        except Exception as exc:  # best effort: cleanup_incomplete retries at start-up
            log.warning("could not abort multipart upload of %s: %s", obj, exc)

    async def _verify_stored(
        self, key: str, whole: int, part_crcs: list[int], response: dict[str, Any]
    ) -> None:
        """Compare the store's own CRC32C (whole, or composite of parts) with ours: as the
        write's response states it (AWS and SeaweedFS do), else from a HeadObject (a
        request per object, which at 10,000 nodes counts: docs/scale.md)."""
        stored = response.get("ChecksumCRC32C")
        if not stored:
            bucket, obj = self._bucket_key(key)
            head = await self._s3("head_object", Bucket=bucket, Key=obj, ChecksumMode="ENABLED")
            stored = head.get("ChecksumCRC32C")
        if not stored:
            return  # the store keeps no checksum; each request's was verified on arrival
        if "-" in stored:
            value, _, count = stored.partition("-")
            expect = checksum.value(b"".join(c.to_bytes(4, "big") for c in part_crcs))
            if checksum.from_base64(value) != expect or int(count) != len(part_crcs):
                raise self.mismatch(key, "stored (composite)", checksum.from_base64(value), expect)
        elif checksum.from_base64(stored) != whole:
            raise self.mismatch(key, "stored", checksum.from_base64(stored), whole)

    async def range_source(self, key: str) -> RangeSource:
        """A GetObject URL presigned with the client's current credentials (the signature
        covers no ``Range``, so one URL serves every part)."""
        bucket, obj = self._bucket_key(key)
        await self.fs.set_session()
        s3 = await self.fs.get_s3(bucket)
        url = await s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": obj}, ExpiresIn=PRESIGN_SECONDS
        )
        return RangeSource(str(url))

    def ssl_context(self) -> ssl.SSLContext:
        """The system's CAs, or the bundle botocore is told to use (``AWS_CA_BUNDLE``)."""
        return ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)

    async def read_range_into(self, key: str, start: int, length: int, dst: memoryview) -> None:
        """Stream a ranged GET into ``dst`` in 1 MiB chunks: no whole-part ``bytes`` is
        assembled (fresh memory for each, which these VMs are slow to hand out)."""
        bucket, obj = self._bucket_key(key)
        resp = await self._s3(
            "get_object", Bucket=bucket, Key=obj, Range=f"bytes={start}-{start + length - 1}"
        )
        body = resp["Body"]
        pos = 0
        try:
            while pos < length:
                chunk = await body.read(min(2**20, length - pos))
                if not chunk:
                    break
                dst[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        finally:
            body.close()
        if pos != length:
            raise RemoteError(f"{key}: short read at {start + pos}", transient=True)

    async def native_crc32c(self, key: str) -> int | None:
        """The object's whole-file crc32c: the store's own, or ours from its metadata."""
        bucket, obj = self._bucket_key(key)
        try:
            head = await self._s3("head_object", Bucket=bucket, Key=obj, ChecksumMode="ENABLED")
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(key) from None
            raise
        return stored_crc32c(head)

    async def get_bytes(self, key: str) -> bytes:
        """One GetObject (s3fs's ``cat_file`` first HEADs the object for its size, and
        follows a 404 with a listing): a missing key is FileNotFoundError."""
        bucket, obj = self._bucket_key(key)
        try:
            resp = await self._s3("get_object", Bucket=bucket, Key=obj)
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(key) from None
            raise
        body = resp["Body"]
        try:
            data: bytes = await body.read()
        finally:
            body.close()
        return data

    async def exists(self, key: str) -> bool:
        """One HeadObject (s3fs's ``exists`` follows a 404 with a listing of ``key/``)."""
        try:
            await self.native_crc32c(key)
        except FileNotFoundError:
            return False
        return True

    async def delete(self, keys: list[str]) -> None:
        """DeleteObjects: up to 1,000 keys a request, not one each (missing keys count as
        deleted); a key the store could not delete raises (transient: tried again)."""
        if len(keys) <= 1:
            await super().delete(keys)
            return
        bucket, _ = self._bucket_key("")
        for at in range(0, len(keys), 1000):
            chunk = [{"Key": self._bucket_key(k)[1]} for k in keys[at : at + 1000]]
            out = await self._s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": chunk, "Quiet": True}
            )
            if errors := out.get("Errors"):
                first = errors[0]
                raise RemoteError(
                    f"{self.url}: could not delete {len(errors)} objects, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                    transient=True,
                )

    async def cleanup_incomplete(self, prefix: str) -> int:
        """Abort multipart uploads left open under ``prefix`` (by a killed daemon)."""
        bucket, obj = self._bucket_key(prefix)
        resp = await self._s3("list_multipart_uploads", Bucket=bucket, Prefix=obj)
        uploads = resp.get("Uploads", [])
        for u in uploads:
            await self._abort(bucket, u["Key"], u["UploadId"])
        return len(uploads)

    async def check(self) -> None:
        """HeadBucket: fails fast on a missing bucket, bad endpoint or refused credentials."""
        bucket, _ = self._bucket_key("")
        try:
            await self._s3("head_bucket", Bucket=bucket)
        except Exception as exc:
            raise RemoteError(_explain(exc, bucket), transient=False) from None


def stored_crc32c(head: dict[str, Any]) -> int | None:
    """An object's whole-file crc32c from its HEAD: the store's own, else ours from its
    metadata, which anyone who may write the bucket sets: a value that is not a
    crc32c is none (the caller uploads again, never trusts or fails on it)."""
    stored = head.get("ChecksumCRC32C")
    if isinstance(stored, str) and stored and "-" not in stored:
        with contextlib.suppress(ValueError):
            return checksum.from_base64(stored)
    meta = (head.get("Metadata") or {}).get(META_CRC)
    if isinstance(meta, str) and meta.isascii() and meta.isdigit() and len(meta) <= 10:
        value = int(meta)
        return value if value < 2**32 else None
    return None


def _missing(exc: BaseException) -> bool:
    """An error saying the object is not there (s3fs translates botocore's NoSuchKey)."""
    return type(exc).__name__ in ("NoSuchKey", "FileNotFoundError") or "404" in str(exc)


def _precondition_failed(exc: BaseException) -> bool:
    """A conditional write the store refused: 412 PreconditionFailed, or AWS's 409
    ConditionalRequestConflict (another conditional write to the key in flight)."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return True
    # s3fs turns botocore's PreconditionFailed into OSError(EINVAL) with the message only.
    return "pre-conditions you specified did not hold" in str(exc)


def _explain(exc: BaseException, bucket: str) -> str:
    text = str(exc) or type(exc).__name__
    if "NoCredentials" in type(exc).__name__ or "Unable to locate credentials" in text:
        return (
            "no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run with an instance/pod role"
        )
    if "404" in text or "NoSuchBucket" in text or "Not Found" in text:
        return f"bucket {bucket!r} does not exist (or is not visible to these credentials)"
    if (
        "403" in text
        or "Forbidden" in text
        or "AccessDenied" in text
        or "SignatureDoesNotMatch" in text
    ):
        return f"the credentials were refused for bucket {bucket!r}: {text}"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"{type(exc).__name__}: {text}; check the endpoint ({endpoint or 'AWS default'})"
