"""The restore's chooser over fake tiers and a real catalog: which step, from which
tier, and what happens when a tier fails (daemon/restore/chooser.py)."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ckptd.core.errors import DataLoss, NotFound, Unavailable
from ckptd.core.manifest import Manifest, RankRecord
from ckptd.daemon.catalog import Catalog, Step
from ckptd.daemon.local.lease import Handed, Lease, Want
from ckptd.daemon.restore.chooser import Chooser, Served
from ckptd.daemon.restore.tier import Order, Tier

JOB = "job"


def _manifest(step: int) -> Manifest:
    ranks = [RankRecord(0, "rank-00000.safetensors", 10, 0, None)]
    return Manifest(JOB, step, "n", 1, 1.0, ranks)


class FakeTier:
    """A tier holding the steps in ``held`` (a step the catalog does not know: a
    peer's replica); ``fail`` says how it fails to bring one:
    "unavailable" (Unavailable), "corrupt" (DataLoss, and the step marked unusable, as
    the bucket does), or "lease" (hands a lease instead of committing locally)."""

    def __init__(
        self,
        name: str,
        catalog: Catalog,
        held: list[int],
        fail: dict[int, str] | None = None,
    ) -> None:
        self.name, self.catalog, self.held = name, catalog, held
        self.fail = fail or {}
        self.asked: list[int] = []

    async def holds(self, job: str, step: int | None) -> list[Order]:
        return [(True, 0, n) for n in sorted(self.held, reverse=True) if step in (None, n)]

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        self.asked.append(step)
        if step not in self.held:
            raise NotFound(f"{self.name} holds no {step}")
        how = self.fail.get(step, "")
        st = self.catalog.get(job, step)
        if how == "unavailable":
            raise Unavailable(f"{self.name} could not give {step}")
        if how == "corrupt":
            if st is not None:
                self.catalog.unusable(st, f"{self.name}'s copy does not verify")
            raise DataLoss(f"{self.name}'s copy of {step} does not verify")
        if how == "lease":
            return Handed(cast(Lease, SimpleNamespace(lease_id=f"{self.name}-{step}")))
        if st is None:
            self.catalog.peer_fetched(_manifest(step), self.name)
        elif not st.local:
            self.catalog.fetched(st, _manifest(step))
        return None


class LocalTier:
    """The local tier: what the catalog says is committed here, served as a file."""

    name = "local"

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.asked: list[int] = []

    async def holds(self, job: str, step: int | None) -> list[Order]:
        return [s.order for s in self.catalog.list(job) if s.local and step in (None, s.step)]

    async def bring(self, job: str, step: int, want: Want) -> Handed | None:
        self.asked.append(step)
        st = self.catalog.get(job, step)
        if st is None or not st.local:
            raise NotFound(f"no local copy of {step}")
        return None


def _catalog(local: list[int], bucket: list[int]) -> Catalog:
    catalog = Catalog("n")
    for n in local:
        catalog.recovered(_manifest(n), pinned=False)
    for n in bucket:
        catalog.discovered(JOB, n, {"n"}, False)
    return catalog


def _pick(catalog: Catalog, step: int | None = None) -> Callable[[], Step]:
    """The newest step with a copy the catalog knows that is not marked unusable."""

    def pick() -> Step:
        if step is not None:
            return catalog.require(JOB, step)
        rows = [s for s in catalog.list(JOB) if (s.local or s.in_remote) and not s.unusable]
        if not rows:
            raise NotFound("nothing to restore")
        return rows[0]

    return pick


def _restore(catalog: Catalog, tiers: list[Any], step: int | None = None) -> Served:
    local = next(t for t in tiers if t.name == "local")
    chooser = Chooser(catalog, cast(list[Tier], tiers), local)
    return asyncio.run(chooser.restore(JOB, step, Want(0), _pick(catalog, step)))


def test_the_newest_verified_step_wins_whichever_tier_holds_it() -> None:
    catalog = _catalog(local=[3], bucket=[5])
    local, bucket = LocalTier(catalog), FakeTier("remote", catalog, [5])
    served = _restore(catalog, [local, bucket])
    assert (served.step.step, served.tier) == (5, "remote")
    assert served.step.local  # brought into the local tier, and served from there
    assert local.asked == [5, 5]  # asked first (no copy yet), then after the bucket


def test_a_step_only_a_peer_holds_is_taken_when_it_is_the_newest() -> None:
    catalog = _catalog(local=[], bucket=[5])
    peer = FakeTier("peer", catalog, [6])
    bucket = FakeTier("remote", catalog, [5])
    served = _restore(catalog, [LocalTier(catalog), peer, bucket])
    assert (served.step.step, served.tier) == (6, "local")  # local by the time it is served
    assert bucket.asked == []


def test_an_older_replica_than_the_bucket_s_newest_is_not_taken() -> None:
    catalog = _catalog(local=[], bucket=[5])
    peer = FakeTier("peer", catalog, [4])
    bucket = FakeTier("remote", catalog, [5])
    served = _restore(catalog, [LocalTier(catalog), peer, bucket])
    assert (served.step.step, served.tier) == (5, "remote")
    assert peer.asked == [5]  # asked for the chosen step first (it holds none), never 4


def test_an_equal_step_comes_from_the_fastest_tier() -> None:
    catalog = _catalog(local=[], bucket=[5])
    peer, bucket = FakeTier("peer", catalog, [5]), FakeTier("remote", catalog, [5])
    served = _restore(catalog, [LocalTier(catalog), peer, bucket])
    assert (served.step.step, served.tier) == (5, "peer")
    assert bucket.asked == []


def test_a_lease_from_a_faster_tier_is_the_answer() -> None:
    catalog = _catalog(local=[5], bucket=[5])
    memory = FakeTier("memory", catalog, [5], fail={5: "lease"})
    local = LocalTier(catalog)
    served = _restore(catalog, [memory, local, FakeTier("remote", catalog, [5])])
    assert served.tier == "memory" and served.handed is not None
    assert local.asked == []


def test_a_failing_tier_passes_the_step_to_the_next_holder() -> None:
    catalog = _catalog(local=[], bucket=[5])
    peer = FakeTier("peer", catalog, [5], fail={5: "unavailable"})
    bucket = FakeTier("remote", catalog, [5])
    served = _restore(catalog, [LocalTier(catalog), peer, bucket])
    assert (served.step.step, served.tier) == (5, "remote")
    assert peer.asked == [5] and bucket.asked == [5]


def test_a_copy_that_does_not_verify_is_skipped_for_the_next_newest_step() -> None:
    catalog = _catalog(local=[3], bucket=[5])
    bucket = FakeTier("remote", catalog, [5], fail={5: "corrupt"})
    served = _restore(catalog, [LocalTier(catalog), bucket])
    assert (served.step.step, served.tier) == (3, "local")
    assert catalog.require(JOB, 5).unusable


def test_a_replica_that_does_not_verify_is_skipped_for_the_bucket_s_copy() -> None:
    catalog = _catalog(local=[], bucket=[5])
    peer = FakeTier("peer", catalog, [6], fail={6: "corrupt"})
    served = _restore(catalog, [LocalTier(catalog), peer, FakeTier("remote", catalog, [5])])
    assert (served.step.step, served.tier) == (5, "remote")


def test_a_step_asked_for_whose_only_copy_does_not_verify_raises() -> None:
    catalog = _catalog(local=[3], bucket=[5])
    bucket = FakeTier("remote", catalog, [5], fail={5: "corrupt"})
    with pytest.raises(DataLoss, match="does not verify"):
        _restore(catalog, [LocalTier(catalog), bucket], step=5)


def test_when_no_tier_gives_the_step_and_nothing_changed_the_reason_is_raised() -> None:
    """No loop: a choice is made again only when what the catalog knows changed."""
    catalog = _catalog(local=[], bucket=[5])
    bucket = FakeTier("remote", catalog, [5], fail={5: "unavailable"})
    with pytest.raises(Unavailable, match="could not give 5"):
        _restore(catalog, [LocalTier(catalog), bucket])
    assert bucket.asked == [5]


def test_the_api_reaches_the_tiers_only_through_the_restorer() -> None:
    """The servicer translates; which tier gives a copy is the chooser's. The tiers
    answer restore's interface by its shape and never import restore (above them)."""
    daemon = Path(__file__).resolve().parents[4] / "src" / "ckptd" / "daemon"
    api = {m for p in (daemon / "api").glob("*.py") for m in _daemon_imports(p)}
    assert not {m for m in api if m.startswith(("remote", "peer"))}
    assert {m for m in api if m.startswith("restore")} == {"restore.restorer"}
    for tier in ("local", "peer", "remote"):
        for p in (daemon / tier).glob("*.py"):
            assert not {m for m in _daemon_imports(p) if m.startswith("restore")}, p


def _daemon_imports(path: Path) -> set[str]:
    """The daemon modules ``path`` imports, named from ``ckptd.daemon`` (``remote.read``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 2:
            base = node.module or ""
            found |= {base} if base else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptd.daemon."):
            found.add((node.module or "").removeprefix("ckptd.daemon."))
    return found
