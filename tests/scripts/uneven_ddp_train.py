"""Trains in float64 under ``MGPUDDPStrategy(uneven_batches=...)``; tests/test_uneven_ddp.py replays it on one device.

Each rank writes ``rank{N}.json`` under ``--out``: the dataset indices of every batch it ran, the real rows the
strategy planned for it, every value its logger received, its step count and its ``rows_seen`` buffer; and
``params{N}.pt``, its parameters at the end. ``--pytorch-lightning`` runs it all on ``pytorch_lightning``'s classes,
with a ``lightning_mgpu.MGPUDDPStrategy`` instance that its Trainer turns into that namespace's strategy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import regression_data  # noqa: E402
from recorder import recorder_class  # noqa: E402

import lightning_mgpu  # noqa: E402

PYTORCH_LIGHTNING = "--pytorch-lightning"
pl = importlib.import_module("pytorch_lightning" if PYTORCH_LIGHTNING in sys.argv else "lightning.pytorch")


def dataset(rows: int) -> TensorDataset:
    """``regression_data`` in float64, with each row's index as a third tensor."""
    x, y = regression_data(rows=rows).tensors
    return TensorDataset(x.double(), y.double(), torch.arange(rows))


def network() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


class Uneven(pl.LightningModule):
    """Per-row errors from the step, the loss and the logged values in ``training_step_end``, as 1.x DP code did.

    ``rows_seen`` counts the rows every forward saw (a padding row must not count), ``scale`` is a buffer the
    backward needs (putting a padding row's buffers back must not touch it before the backward has run), and
    ``error_mean`` is a torchmetrics mean of the errors (a padding row must not enter it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.float64))
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))
        self.error_mean = torchmetrics.MeanMetric()
        self.error_mean.set_dtype(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen += x.shape[0]
        return self.net(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y, _ = batch
        return {"errors": (self(x) - y).pow(2).squeeze(1)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        errors = output["errors"]
        loss = errors.mean()
        self.error_mean(errors)
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("rows", float(errors.shape[0]), reduce_fx="sum", on_step=True, on_epoch=True, sync_dist=True)
        self.log("largest", errors.max(), reduce_fx="max", on_step=True, on_epoch=True, sync_dist=True)
        self.log("error_mean", self.error_mean, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


Recorder = recorder_class(pl.loggers.Logger)


class Batches(pl.Callback):
    def __init__(self, out: Path, logger: Recorder) -> None:
        self.out = out
        self.logger = logger
        self.batches: dict[int, list[list[int]]] = {}
        self.rows: dict[int, list[list[int]]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches.setdefault(trainer.current_epoch, []).append(batch[2].tolist())
        uneven = trainer.strategy._uneven
        shards = uneven.shards if uneven is not None else None
        self.rows.setdefault(trainer.current_epoch, []).append(list(shards.rows(batch_idx)) if shards else [])

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        report = {
            "batches": self.batches,
            "rows": self.rows,
            "logged": self.logger.logged,
            "global_step": trainer.global_step,
            "rows_seen": float(module.rows_seen),
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(report))
        torch.save(dict(module.net.state_dict()), self.out / f"params{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--uneven", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps; 0: none")
    parser.add_argument("--ckpt-in", type=Path)
    parser.add_argument(PYTORCH_LIGHTNING, action="store_true", help="pytorch_lightning's classes (read on import)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    logger = Recorder()
    callbacks: list[pl.Callback] = [Batches(args.out, logger)]
    if args.checkpoint_every:
        every = args.checkpoint_every
        checkpoint = pl.callbacks.ModelCheckpoint(
            args.out / "checkpoints", "{step}", save_top_k=-1, every_n_train_steps=every
        )
        callbacks.append(checkpoint)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=lightning_mgpu.MGPUDDPStrategy(uneven_batches=args.uneven, timeout=timedelta(seconds=60)),
        max_epochs=args.epochs,
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_every),
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(dataset(args.rows), batch_size=args.batch, shuffle=True)
    trainer.fit(Uneven(), loader, ckpt_path=args.ckpt_in)


if __name__ == "__main__":
    main()
