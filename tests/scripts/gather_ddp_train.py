"""Trains a whole-batch loss of tests/batch_losses.py under ``mgpu_ddp``; tests/test_gather_ddp.py checks it.

``MGPUDDPStrategy(uneven_batches=True, gather_step_end=...)`` on ``--devices`` gloo processes, ``--batch`` rows per
rank, the data in its own order. Each rank writes ``rank{N}.json`` under ``--out``: the loss Lightning received at
every step, every value its logger received, the gradients of the first step (after DDP's average) and the
parameters at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batch_losses import MODELS, views  # noqa: E402

import lightning_mgpu  # noqa: E402


class Recorder(L.pytorch.loggers.Logger):
    """Keeps every value the loop logs, on every rank (Lightning's own loggers write from rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append({key: float(value) for key, value in metrics.items()})

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


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
        report = {
            "losses": self.losses,
            "logged": self.logger.logged,
            "gradients": self.gradients,
            "parameters": {name: p.detach().flatten().tolist() for name, p in module.named_parameters()},
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rows", type=int, default=23)
    parser.add_argument("--val-rows", type=int, default=13)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gather", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    logger = Recorder()
    strategy = lightning_mgpu.MGPUDDPStrategy(
        uneven_batches=True, gather_step_end=args.gather, timeout=timedelta(seconds=60)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
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
    trainer.fit(MODELS[args.model](), train, val)


if __name__ == "__main__":
    main()
