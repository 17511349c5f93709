"""Reading one step from one tier, as the checker needs to compare every tier's copy.

- Through the daemon (:func:`restore`): ``memory=True`` lets the daemon serve the
  memory tier (a copy-on-write mapping of the segment it keeps); ``memory=False``
  passes it over, so the local copy (read into shared memory, or the file mapped
  with ``shared_memory=False``) or else the bucket's, fetched, answers. The reply
  says which tier served.
- The bucket itself (:func:`read_bucket`): the step pulled as ``ckptd pull`` does
  (checked, an incremental step made whole from the steps it references), then read
  from the pulled files. No daemon involved, so it checks what the bucket holds.
- The peer's replica (:func:`read_files` on its directory): the files the peer
  node holds for this node, read as they lie.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ckptd.client import CkptdError, Client, mapped_views, restore_flow
from ckptd.client.leaves.jax_arrays import build_leaf
from ckptd.client.shards import ShardReader
from ckptd.core.session import open_readable
from ckptd.proto import ckptd_pb2 as pb

TIER_NAMES = {pb.TIER_MEMORY: "MEMORY", pb.TIER_LOCAL: "LOCAL", pb.TIER_REMOTE: "REMOTE"}


def restore(
    client: Client, step: int | None, *, memory: bool, shared_memory: bool = True
) -> tuple[Any, dict[str, Any], str]:
    """``(tree, metadata, tier that served)`` for ``step`` (None: the newest live one)."""
    conn = client.connection
    req = pb.RestoreRequest(
        job=client.job, rank=0, shared_memory=shared_memory, copy_on_write=memory
    )
    if step is not None:
        req.step = step
    resp = conn.restore(req, None, client._handoff.liveness.metadata())
    tier = TIER_NAMES.get(resp.tier, pb.Tier.Name(resp.tier))
    manifest = json.loads(resp.manifest_json)

    def opener(path: str) -> int:
        return open_readable(conn.session, path)

    holders = dict(resp.holder_directories)  # a replaced holder's held copy: not beside
    reader = ShardReader(resp.directory, manifest, opener, holders)
    leaf = restore_flow.jax_leaf_builder(conn, client.job, reader, resp)

    def adopt(arrays: dict[str, Any]) -> None:
        reader.adopt(0, arrays)

    try:
        if resp.HasField("lease"):
            tree, meta = restore_flow.adopt_segment(conn, 0, resp, manifest, leaf, None, adopt)
        else:
            mm = mapped_views.map_file_verified(
                resp.directory, manifest, 0, opener, holders=holders
            )
            tree, meta = mapped_views.build_tree(mm, manifest, 0, 0, leaf, None, adopt)
    finally:
        reader.close()
    return tree, meta, tier


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process while the block runs (the bucket's credentials)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_bucket(
    url: str, env: dict[str, str], steps: list[tuple[str, int]]
) -> dict[tuple[str, int], tuple[Any, dict[str, Any]] | CkptdError]:
    """The bucket's copy of each ``(job, step)``, pulled and checked as ``ckptd pull``
    does, as ``(tree, metadata)``; or the error that says why it cannot be (no complete
    copy, or one that cannot be made whole)."""
    from ckptd.daemon.app import cli_pull
    from ckptd.daemon.remote.backends import open_remote

    where = Path(tempfile.mkdtemp(prefix="ckmodel-pull-"))
    out: dict[tuple[str, int], tuple[Any, dict[str, Any]] | CkptdError] = {}

    async def pull_all() -> None:
        remote = open_remote(url, "", 8 * 2**20, 4)
        try:
            for n, (job, step) in enumerate(steps):
                cfg: Any = SimpleNamespace(remote=url)
                try:
                    await cli_pull._pull_from(remote, cfg, job, step, where / str(n), None)
                except CkptdError as exc:
                    out[job, step] = exc
        finally:
            await remote.close()

    try:
        quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        with environment(env), quiet[0], quiet[1]:
            asyncio.run(pull_all())
        for n, key in enumerate(steps):
            if key not in out:
                out[key] = read_files(where / str(n))
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


def read_files(directory: Path) -> tuple[Any, dict[str, Any]]:
    """``(tree, metadata)`` from a step's files (a pulled step, or a peer's replica:
    an incremental one reads the steps it references beside it), checked against the
    crc32c its manifest records; copies, so the files may go."""
    manifest = json.loads((directory / "manifest.json").read_text())
    reader = ShardReader(str(directory), manifest, _open)
    try:
        mm = mapped_views.map_file_verified(str(directory), manifest, 0, _open)
        tree, meta = mapped_views.build_tree(
            mm,
            manifest,
            0,
            0,
            lambda spec, target: build_leaf(reader, spec, target),
            None,
            lambda arrays: reader.adopt(0, arrays),
        )
        return {k: np.asarray(v).copy() for k, v in tree.items()}, meta
    finally:
        reader.close()


def _open(path: str) -> int:
    return os.open(path, os.O_RDONLY)
