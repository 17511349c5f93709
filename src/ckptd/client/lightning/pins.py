"""Which steps the Lightning integration keeps pinned, and the pin calls themselves
(:mod:`ckptd.client.lightning.store` says why it pins)."""

from __future__ import annotations

import logging
from typing import Any

from ckptd.core.errors import CkptdError, NotFound

from ..client import Client
from ..handle import SaveHandle

log = logging.getLogger("ckptd.lightning")


def names_after_restore(
    saved: dict[str, Any], checkpoint: dict[str, Any], step: int
) -> dict[str, int]:
    """Lightning's names -> steps once ``step`` is restored: the map its save recorded,
    where the name a ``ModelCheckpoint`` calls its last checkpoint names ``step`` (that
    save came right after this one, or never came), and without the names a
    ``ModelCheckpoint`` had already dropped (a run that died before it removed them)."""
    names = {str(k): int(v) for k, v in saved.items()}
    refs, dirs, lasts = live_names(checkpoint)
    for last in lasts:
        if names.get(last, -1) < step:
            names[last] = step
    for name in list(names):
        inside = any(name.startswith(d.rstrip("/") + "/") for d in dirs)
        if inside and name not in refs:
            del names[name]
    return names


def reconcile_pins(client: Client, want: set[int], metric: str) -> set[int]:
    """Pin the steps in ``want`` that have a copy; unpin every other step pinned by
    this integration (those saved with ``metric``: steps newer than the restored one,
    names a dead run never removed). Returns the steps pinned now."""
    rows = client.list()
    mine = {c.step for c in rows if c.pinned and metric in (c.metrics or {})}
    keep = want & {c.step for c in rows if c.tiers}
    for s in sorted(mine - keep):
        set_pin(client, s, False)
    for s in sorted(keep - mine):
        set_pin(client, s, True)
    return keep


class Settle:
    """A save's LOCAL wait, then its pin and the unpins that go with it."""

    def __init__(
        self, client: Client, handle: SaveHandle | None, pin: int | None, unpin: list[int]
    ) -> None:
        self.client, self.handle, self.pin, self.unpin = client, handle, pin, unpin

    def __call__(self) -> None:
        if self.handle is not None:
            self.handle.wait("local")  # a SaveFailed is the trainer's to see
        if self.pin is not None:
            set_pin(self.client, self.pin, True)
        for step in self.unpin:
            set_pin(self.client, step, False)


def set_pin(client: Client, step: int, on: bool) -> None:
    """Pin or unpin ``step``; housekeeping, so a failure is logged, never raised."""
    try:
        client.pin(step, on)
    except NotFound:
        log.debug("step %d of job %r is gone; no pin to change", step, client.job)
    except CkptdError as exc:
        what = "pin" if on else "unpin"
        log.warning("could not %s step %d of job %r: %s", what, step, client.job, exc)


def live_names(checkpoint: dict[str, Any]) -> tuple[set[str], set[str], set[str]]:
    """What the checkpoint's ``ModelCheckpoint`` states refer to: ``(names, dirs,
    lasts)``: every checkpoint path they name (top-k, best, last), their
    directories, and the paths they call their last checkpoint."""
    names: set[str] = set()
    dirs: set[str] = set()
    lasts: set[str] = set()
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return names, dirs, lasts
    for state in callbacks.values():
        if not isinstance(state, dict) or "best_k_models" not in state:
            continue
        best_k = state.get("best_k_models")
        if isinstance(best_k, dict):
            names.update(k for k in best_k if isinstance(k, str))
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            value = state.get(key)
            if isinstance(value, str) and value:
                names.add(value)
        dirpath, last = state.get("dirpath"), state.get("last_model_path")
        if isinstance(dirpath, str) and dirpath:
            dirs.add(dirpath)
        if isinstance(last, str) and last:
            lasts.add(last)
    return names, dirs, lasts
