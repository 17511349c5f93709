"""One conformance suite for the one commit protocol, run on every place ckptd commits:
the local tier (a save, a download from the bucket, a put-back into a watched
directory), the drain's marker-last commit and the adopted-tree publish, on
file://, S3 (SeaweedFS) and GCS (fake-gcs-server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.core.errors import Conflict
from ckptd.daemon.commit import Commit, MarkerCommit, RenameCommit
from ckptd.daemon.local.store import LocalStore
from ckptd.daemon.remote.base import Remote

from .conftest import RemoteTarget

PIECES = {"a.bin": b"first piece", "sub/b.bin": b"second piece"}


class Harness:
    """How one implementation is begun, written into and read back."""

    replaces = False
    """Whether a second commit of the same final location replaces the first."""

    async def begin(self) -> Commit:
        raise NotImplementedError

    async def put(self, c: Commit, name: str, data: bytes) -> None:
        raise NotImplementedError

    async def read(self, name: str) -> bytes | None:
        """A piece as a reader of the final location sees it (None: absent)."""
        raise NotImplementedError

    async def staged(self, c: Commit) -> list[str]:
        """What is left at the temporary location."""
        raise NotImplementedError

    async def marker(self) -> bytes | None:
        raise NotImplementedError


class LocalHarness(Harness):
    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.store = LocalStore(tmp / "root")
        self.store.recover()
        self.final = self.store.step_dir("job", 7)
        if kind == "put-back":
            self.final = tmp / "orbax" / "7"
            self.final.parent.mkdir()

    async def begin(self) -> Commit:
        if self.kind == "local-step":
            return self.store.begin_step("job", 7, asyncio.to_thread)
        if self.kind == "local-fetch":
            return self.store.begin_step("job", 7, asyncio.to_thread, fetch=True)
        tmp = self.final.with_name(f".ckptd-7.{time.time_ns()}")
        return RenameCommit(self.final, tmp, "commit_success.txt")

    async def put(self, c: Commit, name: str, data: bytes) -> None:
        assert isinstance(c, RenameCommit)
        path = c.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    async def read(self, name: str) -> bytes | None:
        path = self.final / name
        return path.read_bytes() if path.exists() else None

    async def staged(self, c: Commit) -> list[str]:
        assert isinstance(c, RenameCommit)
        return sorted(str(p) for p in c.path.rglob("*")) if c.path.exists() else []

    async def marker(self) -> bytes | None:
        name = "commit_success.txt" if self.kind == "put-back" else "manifest.json"
        return await self.read(name)


class RemoteHarness(Harness):
    def __init__(self, kind: str, remote: Remote) -> None:
        self.kind = kind
        self.r = remote
        if kind == "marker":  # the drain: a node's part, its _complete marker last
            self.final, self.marker_key = "job/7/node-a", "job/7/_complete/node-a"
            self.replaces = True
        else:  # an adopted tree where its framework reads it, commit_success.txt last
            self.final, self.marker_key = "job/7", "job/7/commit_success.txt"
            self.replaces = True

    async def begin(self) -> Commit:
        if self.kind == "marker":
            return MarkerCommit(self.r, self.final, self.marker_key)
        return self.r.tree_commit(self.final, "job/7.ckptd", "node-a")

    async def put(self, c: Commit, name: str, data: bytes) -> None:
        await self.r.put_bytes(f"{c.location}/{name}", data)

    async def read(self, name: str) -> bytes | None:
        try:
            return await self.r.get_bytes(f"{self.final}/{name}")
        except FileNotFoundError:
            return None

    async def staged(self, c: Commit) -> list[str]:
        if isinstance(c, RenameCommit):
            return sorted(str(p) for p in c.path.rglob("*")) if c.path.exists() else []
        return await self.r.list_keys(c.location + "/")

    async def marker(self) -> bytes | None:
        try:
            return await self.r.get_bytes(self.marker_key)
        except FileNotFoundError:
            return None


async def write_all(h: Harness, version: bytes = b"") -> Commit:
    c = await h.begin()
    for name, data in PIECES.items():
        await h.put(c, name, data + version)
    return c


async def nothing_visible_before_the_commit_point(h: Harness) -> None:
    c = await write_all(h)
    assert not await c.committed()
    if isinstance(c, RenameCommit):  # a rename: nothing at all at the final name yet
        assert await h.read("a.bin") is None
    assert await h.marker() is None
    await c.finalize(b"the marker")
    assert await c.committed()
    for name, data in PIECES.items():
        assert await h.read(name) == data
    assert await h.marker() == b"the marker"


async def abort_leaves_nothing(h: Harness) -> None:
    c = await write_all(h)
    await c.abort()
    assert not await c.committed()
    assert await h.staged(c) == []
    assert await h.marker() is None


async def a_second_commit_of_the_same_step(h: Harness) -> None:
    first = await write_all(h, b" v1")
    await first.finalize(b"marker v1")
    second = await write_all(h, b" v2")
    if h.replaces:  # a retried publish replaces what an earlier attempt committed
        await second.finalize(b"marker v2")
        assert await h.read("a.bin") == b"first piece v2"
        assert await h.marker() == b"marker v2"
    else:  # a committed step is never overwritten
        with pytest.raises(Conflict, match="already committed"):
            await second.finalize(b"marker v2")
        await second.abort()
        assert await h.read("a.bin") == b"first piece v1"
        assert await h.marker() == b"marker v1"
        assert await h.staged(second) == []


Scenario = Callable[[Harness], Awaitable[None]]
SCENARIOS: list[Scenario] = [
    nothing_visible_before_the_commit_point,
    abort_leaves_nothing,
    a_second_commit_of_the_same_step,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("kind", ["local-step", "local-fetch", "put-back"])
def test_local_commits(kind: str, scenario: Scenario, tmp_path: Path) -> None:
    asyncio.run(scenario(LocalHarness(kind, tmp_path)))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("kind", ["marker", "tree"])
def test_remote_commits(kind: str, scenario: Scenario, remote: RemoteTarget) -> None:
    async def body(r: Any) -> None:
        await scenario(RemoteHarness(kind, r))

    remote.run(body)


def test_each_tier_uses_the_implementation_its_readers_need(remote: RemoteTarget) -> None:
    async def body(r: Remote) -> None:
        tree = r.tree_commit("job/7", "job/7.ckptd", "node-a")
        # file:// readers (Orbax on a path) take any directory as finished: build aside
        # and rename; object stores go by the commit file.
        assert isinstance(tree, RenameCommit if remote.kind == "file" else MarkerCommit)

    remote.run(body)
