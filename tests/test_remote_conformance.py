"""One contract for the remote adapter, run on file://, S3 (SeaweedFS) and GCS (fake-gcs-server)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest

from ckptd.daemon.remote.base import Remote, RemoteError

from .conftest import RemoteTarget

PART = 5 * 2**20


def run(target: RemoteTarget, body: Callable[[Remote], Awaitable[Any]]) -> Any:
    """Run ``body`` against a fresh adapter with ``PART``-sized parts."""
    return target.run(body, PART)


def random_file(path: Path, size: int, seed: int = 0) -> int:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return int(google_crc32c.value(data))


def test_small_objects_round_trip_with_native_crc(remote: RemoteTarget) -> None:
    async def body(r: Remote) -> None:
        await r.check()
        await r.put_bytes("job/1/node/manifest.json", b'{"a": 1}')
        assert await r.get_bytes("job/1/node/manifest.json") == b'{"a": 1}'
        assert await r.native_crc32c("job/1/node/manifest.json") == google_crc32c.value(b'{"a": 1}')
        assert await r.exists("job/1/node/manifest.json")
        assert not await r.exists("job/1/node/other")
        with pytest.raises(FileNotFoundError):
            await r.native_crc32c("job/1/node/other")

    run(remote, body)


@pytest.mark.parametrize("size", [0, 1000, 3 * PART + 12345])
def test_files_upload_verified_and_download_in_ranges(
    remote: RemoteTarget, tmp_path: Path, size: int
) -> None:
    src = tmp_path / "src.bin"
    want = random_file(src, size, seed=size)

    async def body(r: Remote) -> None:
        await r.put_file(src, "j/2/n/rank-00000.safetensors", size, want)
        assert await r.native_crc32c("j/2/n/rank-00000.safetensors") == want
        assert await r.list_keys("j") == ["j/2/n/rank-00000.safetensors"]
        got = await r.download("j/2/n/rank-00000.safetensors", tmp_path / "dl.bin", size)
        assert got == want
        assert (tmp_path / "dl.bin").read_bytes() == src.read_bytes()
        if size:
            mid = await r.get_range("j/2/n/rank-00000.safetensors", size // 3, size // 3 + 100)
            assert mid == src.read_bytes()[size // 3 : size // 3 + 100]
        await r.delete(["j/2/n/rank-00000.safetensors", "j/2/n/missing"])
        assert await r.list_keys("j") == []
        assert await r.cleanup_incomplete("") == 0

    run(remote, body)


def test_upload_that_disagrees_with_the_commit_crc_is_refused(
    remote: RemoteTarget, tmp_path: Path
) -> None:
    src = tmp_path / "src.bin"
    want = random_file(src, 2 * PART + 7)

    async def body(r: Remote) -> None:
        for size in (2 * PART + 7, 1000):  # multipart and single-request uploads
            with pytest.raises(RemoteError, match="recorded at local commit") as info:
                await r.put_file(src, f"j/3/n/bad-{size}", size, want ^ 0xFFFF)
            assert info.value.transient
        # nothing half-written is visible, and no multipart upload is left open
        visible = await r.list_keys("")
        if remote.kind == "gcs":  # GCS has no parts to verify first: the object is checked after
            await r.delete(visible)
            visible = await r.list_keys("")
        assert visible == []
        assert await r.cleanup_incomplete("") == 0

    run(remote, body)


def test_missing_bucket_fails_check_with_a_clear_message(remote: RemoteTarget) -> None:
    if remote.kind == "file":
        target = RemoteTarget("file", "file:///proc/ckptd-cannot-create-this", {})
    else:
        target = RemoteTarget(remote.kind, f"{remote.kind}://no-such-bucket-ckptd/x", remote.env)

    async def body(r: Remote) -> None:
        await r.check()

    with pytest.raises(Exception) as info:
        run(target, body)
    assert str(info.value)
