"""Trains a whole-batch loss of tests/batch_losses.py under ``mgpu_ddp``; tests/test_gather_ddp.py checks it.

``MGPUDDPStrategy(uneven_batches=True, gather_step_end=...)`` on ``--devices`` gloo processes, ``--batch`` rows per
rank, the data in its own order. Each rank writes ``pid-rank{N}`` at the start and, at the end, ``rank{N}.json``
under ``--out``: the loss Lightning received at every step, every value its logger received, the gradients of the
first step (after DDP's average), the parameters, and what ``trainer.test`` on the validation data returned where
the model has a test step. ``--break keys`` makes rank 1's training outputs hold a key the
others lack, ``--break dtype`` rank 1's first tensor float32 where the others' is float64, ``--break object`` every
rank's an object that cannot be pickled, ``--break raise`` rank 0's step raise; ``--slow-rank`` keeps a rank busy in
each step, outside any collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batch_losses import MODELS, views  # noqa: E402
from recorder import recorder_class  # noqa: E402

import lightning_mgpu  # noqa: E402

Recorder = recorder_class(L.pytorch.loggers.Logger)


class Report(L.Callback):
    def __init__(self, out: Path, logger: Recorder) -> None:
        self.out = out
        self.logger = logger
        self.losses: list[float] = []
        self.gradients: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.gradients = {name: p.grad.flatten().tolist() for name, p in module.named_parameters()}

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.write(trainer, module)

    def write(
        self, trainer: L.Trainer, module: L.LightningModule, tested: list[dict[str, float]] | None = None
    ) -> None:
        """The report of the rank, with what ``trainer.test`` returned once it ran."""
        report = {
            "losses": self.losses,
            "logged": self.logger.logged,
            "gradients": self.gradients,
            "parameters": {name: p.detach().flatten().tolist() for name, p in module.named_parameters()},
            "tested": tested,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def fit_and_test(trainer: L.Trainer, model: L.LightningModule, train: DataLoader, val: DataLoader) -> None:
    """Fit, then test on ``val`` where the model has a test step; ``Report`` writes what both gave."""
    trainer.fit(model, train, val)
    if is_overridden("test_step", model):
        tested = [{key: float(value) for key, value in metrics.items()} for metrics in trainer.test(model, val)]
        report = next(callback for callback in trainer.callbacks if isinstance(callback, Report))
        report.write(trainer, model, tested)


def broken(model: type[L.LightningModule], how: str | None, slow_rank: int | None) -> type[L.LightningModule]:
    """``model`` whose training outputs differ between ranks as ``how`` says, or whose ``slow_rank`` is slow."""

    class Broken(model):  # type: ignore[misc,valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            if self.global_rank == slow_rank:
                time.sleep(2)
            if how == "keys" and self.global_rank == 1:
                output["extra"] = output["a"]
            if how == "dtype" and self.global_rank == 1:
                output["a"] = output["a"].float()
            if how == "object":
                output["lock"] = threading.Lock()
            if how == "raise" and self.global_rank == 0:
                raise RuntimeError("rank 0 fails on purpose")
            return output

    return Broken


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--rows", type=int, default=23)
    parser.add_argument("--val-rows", type=int, default=13)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gather", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--break", dest="broken", choices=["keys", "dtype", "object", "raise"])
    parser.add_argument("--slow-rank", type=int)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = next((os.environ[name] for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK") if name in os.environ), "0")
    (args.out / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)

    logger = Recorder()
    strategy = lightning_mgpu.MGPUDDPStrategy(
        uneven_batches=True, gather_step_end=args.gather, timeout=timedelta(seconds=60)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[Report(args.out, logger)],
        enable_checkpointing=False,
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(views(args.rows), batch_size=args.batch, shuffle=False)
    val = DataLoader(views(args.val_rows, seed=1), batch_size=args.batch)
    fit_and_test(trainer, broken(MODELS[args.model], args.broken, args.slow_rank)(), train, val)


if __name__ == "__main__":
    main()
