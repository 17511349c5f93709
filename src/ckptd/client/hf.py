"""Hugging Face ``Trainer`` users: keep ``save_steps``; ckptd tiers every checkpoint.

::

    from ckptd.client import hf as ckptd_hf

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ckptd_hf.CkptdCallback("run-42")])
    trainer.train(resume_from_checkpoint=ckptd_hf.resume(trainer))

The callback hands each ``output_dir/checkpoint-N`` the Trainer finished to the
node's daemon (``Client.adopt``: hard links, so the Trainer's own
``save_total_limit`` deletions cannot race the upload; LOCAL when it returns,
then drained byte-identical to ``<remote>/<job>/N/``). The Trainer writes a
checkpoint in place with no commit file, so only its ``on_save`` (called after
``_save_checkpoint`` wrote the model, optimizer, scheduler, RNG states and
``trainer_state.json``) says one is whole: the daemon never adopts a
``checkpoint-N`` on its own.

:func:`resume` puts the newest adopted step back into ``output_dir/checkpoint-N``
(from the bucket when the node lost its disk) and returns that path (None: a
fresh start); ``trainer.train(resume_from_checkpoint=True)`` finds it there too.
See docs/integrations/hf.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptd.core.errors import (
    CheckpointNotFound,
    CkptdError,
    FailedPrecondition,
    InvalidArgument,
)
from ckptd.core.health import RESERVED_PREFIX
from ckptd.proto import ckptd_pb2 as pb

from .adopted import adopted_steps, agree, barrier, gather, world
from .client import Client
from .handle import SaveHandle

log = logging.getLogger("ckptd.hf")

LAYOUT = "hf"
"""The daemon's name for the Trainer's step directories (``checkpoint-<step>``)."""
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CkptdCallback(TrainerCallback):
    """Adopts every checkpoint the Trainer saves into the node's ckptd daemon.

    ``job``: the job's name (or pass ``client``: a :class:`Client` of it);
    ``socket``: the daemon's (default: ``$CKPTD_SOCKET``, else the default path).
    ``metrics``: hand the values the Trainer logged at the saved step (``loss``,
    ``eval_loss``, ...) to the daemon, so ckptd's ``KeepBest``/``BestN`` retention
    can rank the steps. ``milestone(state)``: True marks a step as a milestone.

    On the training path it costs the adoption call (hard links, an fsync and a
    crc32c per file), plus, in a multi-process job, one barrier so every rank's
    files (``rng_state_<rank>.pth``) are in before the directory is handed over.
    Each process that writes the checkpoint (``args.should_save``: the main process,
    or each node's with ``save_on_each_node``) adopts it into its node's daemon.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        client: Client | None = None,
        socket: str | os.PathLike[str] | None = None,
        metrics: bool = True,
        milestone: Callable[[TrainerState], bool] | None = None,
    ) -> None:
        if (job is None) == (client is None):
            raise TypeError("give the job's name (CkptdCallback('run-42')) or a client=")
        self._client = client
        self._job = job if client is None else client.job
        self._socket = socket
        self.metrics = metrics
        self.milestone = milestone
        self.last: SaveHandle | None = None
        """The handle of this process's last adoption (None before the first)."""
        self.adopted: list[int] = []
        """Steps this process adopted, in order."""

    @property
    def client(self) -> Client:
        """The client of the job (created at first use, so building the callback needs
        no daemon)."""
        if self._client is None:
            # The Trainer names each checkpoint-N it saved: each is written.
            self._client = Client(str(self._job), socket=self._socket, supersede=False)
        return self._client

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Make ``save_total_limit`` and the best checkpoint the job's retention in
        every ckptd tier (:func:`retention_of`), on each process that adopts."""
        if not args.should_save:
            return
        try:  # None (no limit) too: an earlier run's policy must not stay
            self.client.set_retention(retention_of(args, self.metrics))
        except FailedPrecondition as exc:  # the operator keeps every job's retention
            log.warning("save_total_limit is not applied to job %r: %s", self.client.job, exc)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Adopt ``output_dir/checkpoint-<global_step>``, which the Trainer just finished."""
        step = int(state.global_step)
        path = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        # The Trainer writes rng_state_<rank>.pth on every rank and calls on_save with
        # no barrier in between: without one, another rank's file could be missing.
        barrier()
        if not args.should_save:
            return
        if not path.is_dir():
            raise FailedPrecondition(
                f"the Trainer saved step {step} but {path} is not a directory: ckptd adopts "
                "checkpoints under args.output_dir (hyperparameter-search runs, which save "
                "elsewhere, are not supported)"
            )
        self.last = self.client.adopt(
            step,
            path,
            milestone=bool(self.milestone(state)) if self.milestone else False,
            metrics=logged_metrics(state, step) if self.metrics else None,
        )
        self.adopted.append(step)

    def wait(self, stage: str = "durable", timeout: float = 600.0) -> None:
        """Block until this process's last adoption reached ``stage`` ("local" or
        "durable": in the bucket). Returns at once if it adopted nothing."""
        if self.last is not None:
            self.last.wait(stage, timeout=timeout)

    def close(self) -> None:
        """Close the client this callback created (a given one is the caller's)."""
        if self._client is not None and self._job is not None and self._client.job == self._job:
            self._client.close()
            self._client = None


def retention_of(args: TrainingArguments, metrics: bool = True) -> str | None:
    """The Trainer's own rotation as a ckptd policy: the newest ``save_total_limit``
    and, with ``load_best_model_at_end``, the best by ``metric_for_best_model`` (the
    value the Trainer logged at the step, sent with each adoption unless ``metrics``
    is False; on a tie ckptd keeps the newer step, the Trainer the older). None
    without a limit: the Trainer keeps every checkpoint, and the node's policy
    decides."""
    limit = args.save_total_limit
    if not limit or limit < 0:
        return None
    latest = f"KeepLatest({int(limit)})"
    metric = args.metric_for_best_model
    if not (args.load_best_model_at_end and metric and metrics):
        return latest
    name = metric if metric.startswith("eval_") else f"eval_{metric}"
    mode = "max" if args.greater_is_better else "min"
    return f"KeepAny([{latest}, KeepBest({name!r}, 1, {mode!r})])"


def logged_metrics(state: TrainerState, step: int) -> dict[str, float]:
    """The numbers the Trainer logged at ``step`` (``loss``, ``eval_loss``, ...)."""
    found: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != step:
            continue
        for name, value in entry.items():
            if (
                name != "step"
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and not name.startswith(RESERVED_PREFIX)
                and 0 < len(name) <= 255
            ):
                found[name] = float(value)
    return found


def resume(trainer: Trainer, step: int | None = None, timeout: float = 3600.0) -> str | None:
    """Put the newest adopted step (or ``step``) back into
    ``output_dir/checkpoint-<step>`` and return that path, for
    ``trainer.train(resume_from_checkpoint=...)``; None: nothing to resume from.

    A step the node lost comes back from the bucket, verified; one ckptd holds but
    the Trainer deleted (``save_total_limit``) is linked back. A newer
    ``checkpoint-M`` the daemon never adopted (a save cut short) is not chosen,
    and said so. With no adopted step anywhere, the Trainer's own newest
    checkpoint on disk is returned (with a warning), else None.

    In a multi-process job every process must call it (a collective over
    ``torch.distributed``): the writing processes agree on the newest step each of
    their nodes holds, each puts it back on its node, and all get its path.
    """
    callback = next(
        (c for c in trainer.callback_handler.callbacks if isinstance(c, CkptdCallback)), None
    )
    if callback is None:
        raise InvalidArgument(
            "this Trainer has no CkptdCallback: pass callbacks=[CkptdCallback('<job>')] "
            "when creating it, then call resume(trainer)"
        )
    args = trainer.args
    out = _output_dir(args)
    client = callback.client
    asked = step is not None
    if world() > 1:
        step = agree(client, step, bool(args.should_save))
        if step is None:
            return _fallback(out)
    failure: CkptdError | None = None
    if args.should_save:
        req = pb.EnsureLocalRequest(job=client.job, directory=str(out), layout=LAYOUT)
        if step is not None:
            req.step = int(step)
        try:
            resp = client.low_level.ensure_local(req, timeout)
        except CkptdError as exc:
            if isinstance(exc, CheckpointNotFound) and step is None:
                return _fallback(out)  # one process, and nothing adopted anywhere
            failure = exc
        else:
            step = int(resp.step)
            how = (
                "from the bucket" if resp.fetched else "linked back" if resp.linked else "in place"
            )
            log.info("resuming job %r from step %d (%s, %s)", client.job, step, resp.path, how)
            try:  # best effort: the resume itself stands, and no other process may wait
                _bring_named(client, out, step, args.save_total_limit, timeout)
            except Exception as exc:
                log.warning("the checkpoints step %d's Trainer state names: %s", step, exc)
    # Every process learns whether each node's copy is in place (the others read what
    # their node's writing process put back), and none is left waiting if one failed.
    errors = gather(str(failure) if failure else "")
    if failure is not None:
        raise failure
    if any(errors):
        raise FailedPrecondition(
            f"another process could not put step {step} back: {next(e for e in errors if e)}"
        )
    if step is None:
        return _fallback(out)
    newer = [s for s in _on_disk(out) if s > step]
    if newer:
        why = (
            "you asked for an older step: the Trainer will rewrite them in place, and "
            "ckptd's copies of those steps with them (move them away first; "
            "docs/integrations/hf.md)"
            if asked
            else "ckptd holds no whole copy of them (a save cut short?)"
        )
        log.warning(
            "%s also holds %s, newer than step %d, which it resumes from: %s",
            out,
            ", ".join(f"{PREFIX_CHECKPOINT_DIR}-{s}" for s in newer),
            step,
            why,
        )
    return str(out / f"{PREFIX_CHECKPOINT_DIR}-{step}")


def named_steps(state_file: Path, step: int, held: list[int], limit: int | None) -> list[int]:
    """The steps besides ``step`` that the Trainer whose state ``state_file`` is would
    find in ``output_dir``: its best checkpoint (``best_model_checkpoint``, which
    ``load_best_model_at_end`` loads and rotation never deletes) and, under
    ``save_total_limit``, the newest older ones (of ``held``: the job's adopted steps)
    its rotation kept beside ``step`` and the best: ``limit`` in all. Without a limit
    the Trainer keeps every checkpoint; only the best is brought back then (the rest
    stay in ckptd)."""
    try:
        best = json.loads(state_file.read_text()).get("best_model_checkpoint")
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s is unreadable (%s): no best checkpoint brought back", state_file, exc)
        best = None
    m = _CHECKPOINT.match(Path(best).name) if isinstance(best, str) else None
    wanted = {int(m.group(1))} - {step} if m else set()
    if limit:
        # The Trainer's rotation keeps the newest `limit`, the best counted among them.
        others = sorted((s for s in held if s < step and s not in wanted), reverse=True)
        wanted.update(others[: max(limit - 1 - len(wanted), 0)])
    return sorted(wanted)


def _bring_named(client: Client, out: Path, step: int, limit: int | None, timeout: float) -> None:
    """Put back the other checkpoints the resumed step's Trainer state names
    (:func:`named_steps`): a best checkpoint lost with the node would otherwise make
    ``load_best_model_at_end`` end with the last model, logged only at INFO by the
    Trainer. One ckptd no longer holds is said at WARNING."""
    held = adopted_steps(client)
    state_file = out / f"{PREFIX_CHECKPOINT_DIR}-{step}" / TRAINER_STATE_NAME
    for other in named_steps(state_file, step, held, limit):
        req = pb.EnsureLocalRequest(job=client.job, directory=str(out), layout=LAYOUT, step=other)
        try:
            resp = client.low_level.ensure_local(req, timeout)
        except CkptdError as exc:
            log.warning(
                "step %d's Trainer state names %s, which could not be put back (%s): "
                "the Trainer will go on without it",
                step,
                out / f"{PREFIX_CHECKPOINT_DIR}-{other}",
                exc,
            )
            continue
        log.info("put back %s, which step %d's Trainer state names", resp.path, step)


def _output_dir(args: TrainingArguments) -> Path:
    """The Trainer's ``output_dir``, absolute (the daemon is given absolute paths)."""
    return Path(str(args.output_dir)).absolute()


def _fallback(out: Path) -> str | None:
    """No adopted step anywhere: the Trainer's own newest checkpoint, if any."""
    steps = _on_disk(out)
    if not steps:
        return None
    path = out / f"{PREFIX_CHECKPOINT_DIR}-{steps[-1]}"
    log.warning(
        "ckptd holds no adopted step of this job; resuming from %s, which the Trainer "
        "wrote before ckptd adopted anything (not verified by ckptd)",
        path,
    )
    return str(path)


def _on_disk(out: Path) -> list[int]:
    """Steps of the ``checkpoint-N`` directories in ``out``, oldest first."""
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return []
    return sorted(
        int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n)) and (out / n).is_dir()
    )


__all__ = ["LAYOUT", "CkptdCallback", "logged_metrics", "named_steps", "resume", "retention_of"]
