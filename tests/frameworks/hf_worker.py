"""A tiny GPT-2 trained by the real Hugging Face ``Trainer`` on CPU (tests/frameworks/test_hf.py).

``python -m tests.frameworks.hf_worker OPTIONS`` trains to ``--max-steps``, saving
every ``--save-steps`` into ``--out``, and writes the final model, optimizer and
scheduler state to ``--result`` (torch.save) and a JSON summary as its last stdout
line. With ``--job`` the ckptd callback adopts each checkpoint and ``--resume
ckptd`` / ``ckptd-true`` resumes through ``ckptd.client.hf.resume``. Two processes
(``RANK``/``WORLD_SIZE``/``MASTER_PORT`` in the environment) train with DDP over gloo.

Kill points: ``--kill-after K``: in ``on_save`` of step K, once ckptd adopted it
and it reached the bucket on every node, each process writes ``<result>.ready.<rank>``
and waits there for the test's SIGKILL; ``--kill-mid-save K``: the process SIGKILLs
itself inside the Trainer's save of step K, after the model files and before the
optimizer's (a half-written checkpoint-K).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from ckptd.client import hf as ckptd_hf

VOCAB, SEQ, SAMPLES = 96, 16, 24  # 6 steps an epoch: a resume crosses one


def publish(path: Path, text: str) -> None:
    """Write PATH whole or not at all: the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """SAMPLES fixed random sequences; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        self.ids = torch.from_numpy(np.random.default_rng(7).integers(0, VOCAB, (SAMPLES, SEQ)))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAfter(TrainerCallback):
    """In ``on_save`` of ``step``, once ckptd holds it durably: say so, and wait to be
    killed (by the test: a process killing itself could cut another off mid-barrier)."""

    def __init__(self, step: int, ckptd: ckptd_hf.CkptdCallback, ready: str) -> None:
        self.step, self.ckptd, self.ready = step, ckptd, ready

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            self.ckptd.wait("durable", timeout=120)
            ckptd_hf.barrier()  # every process is past its own wait: all nodes hold it
            publish(Path(f"{self.ready}.{args.process_index}"), "ready")
            threading.Event().wait()


class KillingTrainer(Trainer):
    """The real Trainer, killed inside the save of one step (model written, optimizer not)."""

    kill_mid_save = -1

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.state.global_step == self.kill_mid_save:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_optimizer_and_scheduler(output_dir)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True, help="{rank} is replaced by the process's rank")
    p.add_argument("--job")
    p.add_argument("--socket")
    p.add_argument("--resume", default="no", help="no, ckptd, ckptd-true, or a path")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--kill-mid-save", type=int, default=-1)
    p.add_argument(
        "--best",
        action="store_true",
        help="evaluate at each save and load the best model at the end, the best being "
        "the highest eval_loss (the first checkpoint: one save_total_limit would drop)",
    )
    p.add_argument(
        "--native-check",
        type=int,
        default=-1,
        help="then, in this process, resume from the run's own checkpoint-K with plain HF "
        "into <out>-native (the result as <result>.native): HF's resume is exact by itself",
    )
    return p.parse_args()


def train(a: argparse.Namespace, out: str, result: str, resume_arg: str) -> dict[str, Any]:
    """One Trainer run; its final state goes to ``result``, a summary is returned."""
    args = TrainingArguments(
        output_dir=out,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        save_total_limit=a.save_total_limit,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        disable_tqdm=True,
        **(
            {
                "eval_strategy": "steps",
                "eval_steps": a.save_steps,
                "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss",
                "greater_is_better": True,
            }
            if a.best
            else {}
        ),
    )
    set_seed(0)  # the same initial weights in every run (a resume loads them anyway)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    callbacks: list[TrainerCallback] = []
    ckptd = None
    if a.job:
        ckptd = ckptd_hf.CkptdCallback(a.job, socket=a.socket)
        callbacks.append(ckptd)
        if a.kill_after >= 0:
            callbacks.append(KillAfter(a.kill_after, ckptd, f"{result}.ready"))
    KillingTrainer.kill_mid_save = a.kill_mid_save
    trainer = KillingTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens() if a.best else None,
        callbacks=callbacks,
    )

    resume: str | bool | None = None
    if resume_arg == "ckptd":
        resume = ckptd_hf.resume(trainer)
    elif resume_arg == "ckptd-true":
        ckptd_hf.resume(trainer)  # puts the step back where the Trainer looks
        resume = True
    elif resume_arg != "no":
        resume = resume_arg
    trainer.train(resume_from_checkpoint=resume)

    torch.save(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step,
        },
        result.replace("{rank}", str(args.process_index)),
    )
    if ckptd is not None:
        ckptd.wait("durable", timeout=120)
    return {
        "rank": args.process_index,
        "resumed_from": resume if isinstance(resume, str) else str(resume),
        "adopted": ckptd.adopted if ckptd else [],
        "on_disk": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
        "best": trainer.state.best_model_checkpoint,
    }


def main() -> None:
    a = parse()
    summary = train(a, a.out, a.result, a.resume)
    if a.native_check >= 0:
        native = f"{a.out}/checkpoint-{a.native_check}"
        summary["native"] = train(a, f"{a.out}-native", f"{a.result}.native", native)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
