"""The object-store helpers in tests/servers.py work, and the client facts ckptd relies on hold.

Each server is started once for the module; every test drives it through the fsspec
async API (``s3fs`` / ``gcsfs``) inside an asyncio loop, as the daemon does.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import pytest

from .servers import GRPC_OFFSET, FakeGCS, SeaweedS3, free_port

s3fs = pytest.importorskip("s3fs")
gcsfs_core = pytest.importorskip("gcsfs.core")

MIB = 2**20
BIG = os.urandom(20 * MIB)


def crc_b64(data: bytes | memoryview) -> str:
    """The crc32c as both stores spell it: base64 of the 4 big-endian bytes."""
    return base64.b64encode(google_crc32c.value(bytes(data)).to_bytes(4, "big")).decode()


@pytest.fixture(scope="module")
def s3() -> Iterator[SeaweedS3]:
    with SeaweedS3() as srv:
        yield srv


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGCS]:
    with FakeGCS() as srv:
        yield srv


async def _s3fs(srv: SeaweedS3, **kw: Any) -> Any:
    fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **kw)
    await fs.set_session()
    return fs


async def _close_s3fs(fs: Any) -> None:
    if fs._s3 is not None:
        await fs._s3.close()


def test_free_port() -> None:
    port = free_port(grpc_offset=True)
    assert 15000 <= port < 23000
    for p in (port, port + GRPC_OFFSET):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert free_port() != port


@pytest.mark.slow  # restarts the S3 server
def test_s3_roundtrip_and_restart(
    s3: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.make_bucket("probe-rt")
    src = tmp_path / "big.bin"
    src.write_bytes(BIG)
    # The standard AWS chain, as the daemon sees it: nothing but the environment.
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)

    async def upload_and_check() -> None:
        fs = await _s3fs(s3)
        try:
            await fs._pipe_file(f"{bucket}/a/piped", BIG, ChecksumCRC32C=crc_b64(BIG))
            await fs._put_file(str(src), f"{bucket}/a/put")
            assert sorted(await fs._find(bucket)) == [f"{bucket}/a/piped", f"{bucket}/a/put"]
            assert await fs._ls(f"{bucket}/a", detail=False) == [
                f"{bucket}/a/piped",
                f"{bucket}/a/put",
            ]
            info = await fs._info(f"{bucket}/a/put")
            assert info["size"] == len(BIG) and info["type"] == "file"
            # Ranged reads: end is exclusive; an end past the object is clipped.
            assert await fs._cat_file(f"{bucket}/a/put", start=5, end=1005) == BIG[5:1005]
            n = len(BIG)
            assert await fs._cat_file(f"{bucket}/a/put", start=n - 10, end=n + 99) == BIG[-10:]
            assert await fs._cat_file(f"{bucket}/a/put", start=-10) == BIG[-10:]
            head = await fs._call_s3(
                "head_object", Bucket=bucket, Key="a/piped", ChecksumMode="ENABLED"
            )
            assert head["ChecksumCRC32C"] == crc_b64(BIG)
            await fs._rm(f"{bucket}/a/put")
            assert not await fs._exists(f"{bucket}/a/put")
        finally:
            await _close_s3fs(fs)

    asyncio.run(upload_and_check())

    s3.stop()
    s3.start()

    async def still_there() -> None:
        fs = await _s3fs(s3)
        try:
            assert await fs._cat_file(f"{bucket}/a/piped") == BIG
            await fs._pipe_file(f"{bucket}/after-restart", b"ok")
        finally:
            await _close_s3fs(fs)

    asyncio.run(still_there())


def test_s3_crc32c_verified_by_server(s3: SeaweedS3) -> None:
    """SeaweedFS checks a supplied x-amz-checksum-crc32c (BadDigest) and stores it."""
    bucket = s3.make_bucket("probe-crc")
    part = 5 * MIB
    data = BIG[: 3 * part + 12345]
    parts = [data[o : o + part] for o in range(0, len(data), part)]

    async def run() -> None:
        # One attempt, no botocore retries: a BadDigest is otherwise re-sent 4 times.
        fs = await _s3fs(s3, **s3.s3fs_kwargs(), config_kwargs={"retries": {"max_attempts": 1}})
        call = fs._call_s3
        try:
            with pytest.raises(OSError, match="did not match"):
                await call(
                    "put_object", Bucket=bucket, Key="bad", Body=data, ChecksumCRC32C=crc_b64(b"x")
                )
            assert not await fs._exists(f"{bucket}/bad")

            # Multipart with a full-object CRC32C: the stored checksum is the plain
            # crc32c of the whole object, and the server verified it at completion.
            for key, wrong in (("full", False), ("full-bad", True)):
                mpu = await call(
                    "create_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    ChecksumAlgorithm="CRC32C",
                    ChecksumType="FULL_OBJECT",
                )
                done = []
                for i, p in enumerate(parts, 1):
                    r = await call(
                        "upload_part",
                        Bucket=bucket,
                        Key=key,
                        UploadId=mpu["UploadId"],
                        PartNumber=i,
                        Body=p,
                        ChecksumCRC32C=crc_b64(p),
                    )
                    assert r["ChecksumCRC32C"] == crc_b64(p)
                    done.append({"PartNumber": i, "ETag": r["ETag"], "ChecksumCRC32C": crc_b64(p)})
                complete: dict[str, Any] = dict(
                    Bucket=bucket,
                    Key=key,
                    UploadId=mpu["UploadId"],
                    MultipartUpload={"Parts": done},
                    ChecksumType="FULL_OBJECT",
                    ChecksumCRC32C=crc_b64(b"x" if wrong else data),
                )
                if wrong:
                    with pytest.raises(OSError, match="did not match"):
                        await call("complete_multipart_upload", **complete)
                    await call(
                        "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"]
                    )
                else:
                    r = await call("complete_multipart_upload", **complete)
                    assert r["ChecksumCRC32C"] == crc_b64(data)
            head = await call("head_object", Bucket=bucket, Key="full", ChecksumMode="ENABLED")
            assert (head["ChecksumCRC32C"], head["ChecksumType"]) == (crc_b64(data), "FULL_OBJECT")
            assert head["ContentLength"] == len(data)
            assert not await fs._exists(f"{bucket}/full-bad")
        finally:
            await _close_s3fs(fs)

    asyncio.run(run())


def test_gcs_roundtrip_and_restart(
    gcs: FakeGCS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = gcs.make_bucket("probe-rt")
    src = tmp_path / "big.bin"
    src.write_bytes(BIG)
    for k, v in gcs.env().items():
        monkeypatch.setenv(k, v)

    async def upload_and_check() -> None:
        # gcsfs.core.GCSFileSystem: never the experimental (gRPC-probing) subclass.
        fs = gcsfs_core.GCSFileSystem(asynchronous=True, skip_instance_cache=True)
        try:
            small = BIG[: 3 * MIB]
            obj = await fs._pipe_file(f"{bucket}/a/small", small)  # simple upload
            assert obj["crc32c"] == crc_b64(small)
            # 20 MiB from a file: a resumable upload, here in 3 chunks of 8 MiB.
            await fs._put_file(str(src), f"{bucket}/a/put", chunksize=8 * MIB)
            assert sorted(await fs._find(bucket)) == [f"{bucket}/a/put", f"{bucket}/a/small"]
            assert await fs._ls(f"{bucket}/a", detail=False) == [
                f"{bucket}/a/put",
                f"{bucket}/a/small",
            ]
            info = await fs._info(f"{bucket}/a/put")
            assert info["size"] == len(BIG) and info["type"] == "file"
            assert info["crc32c"] == crc_b64(BIG)  # of the whole object
            assert await fs._cat_file(f"{bucket}/a/put", start=5, end=1005) == BIG[5:1005]
            n = len(BIG)
            assert await fs._cat_file(f"{bucket}/a/put", start=n - 10, end=n + 99) == BIG[-10:]
            assert await fs._cat_file(f"{bucket}/a/put", start=-10) == BIG[-10:]
            await fs._rm(f"{bucket}/a/small")
            assert not await fs._exists(f"{bucket}/a/small")
        finally:
            if fs._session is not None:
                await fs._session.close()

    asyncio.run(upload_and_check())

    gcs.stop()
    gcs.start()

    async def still_there() -> None:
        fs = gcsfs_core.GCSFileSystem(asynchronous=True, skip_instance_cache=True)
        try:
            assert await fs._cat_file(f"{bucket}/a/put") == BIG
            assert (await fs._info(f"{bucket}/a/put"))["crc32c"] == crc_b64(BIG)
        finally:
            if fs._session is not None:
                await fs._session.close()

    asyncio.run(still_there())


def test_pause_resume(gcs: FakeGCS) -> None:
    import urllib.request

    gcs.pause()
    try:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{gcs.endpoint_url}/storage/v1/b", timeout=0.5)
    finally:
        gcs.resume()
    with urllib.request.urlopen(f"{gcs.endpoint_url}/storage/v1/b", timeout=5) as r:
        assert r.status == 200
