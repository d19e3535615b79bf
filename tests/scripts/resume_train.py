"""Trains a small model with checkpoints; tests/test_resume.py kills it mid-run with SIGKILL and resumes it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import PositionKeepingLoader, Regressor, regression_data  # noqa: E402

import lightning_mgpu  # noqa: E402, F401 - registers the strategies


class Logged(Regressor):
    """Under mgpu_ddp the step uses dropout, so the resumed run must also continue the random streams exactly.

    (Not under mgpu_dp: virtual replicas on one CPU share its generator, and threads draw from it in no fixed order.)
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(torch.nn.functional.dropout(self(x), self.dropout, self.training), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss


class Slow(L.Callback):
    """Gives the test time to kill the run between two checkpoints."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


class Report(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        optimizer = trainer.optimizers[0].state_dict()
        torch.save({"params": module.state_dict(), "optimizer": optimizer}, self.out / "final.pt")
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        (self.out / "report.json").write_text(json.dumps({"metrics": metrics, "losses": self.losses}))


def main() -> None:
    parser = lightning_mgpu.add_local_rank_argument(argparse.ArgumentParser())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["mgpu_dp", "mgpu_ddp"], required=True)
    parser.add_argument("--every", type=int, default=0, help="checkpoint every N steps; 0: at each epoch end")
    parser.add_argument("--ckpt-in", type=Path)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--position-keeping", action="store_true", help="a DataLoader that keeps its own place")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(7)
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "checkpoints", filename="{step}", save_top_k=-1,
        every_n_train_steps=args.every or None, every_n_epochs=None if args.every else 1,
    )  # fmt: skip
    callbacks: list[L.Callback] = [checkpoint, Report(args.out)]
    if args.sleep:
        callbacks.append(Slow(args.sleep))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=3,
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader_class = PositionKeepingLoader if args.position_keeping else DataLoader
    data = loader_class(regression_data(rows=40), batch_size=4, shuffle=True)
    trainer.fit(Logged(dropout=0.2 if args.strategy == "mgpu_ddp" else 0.0), data, ckpt_path=args.ckpt_in)


if __name__ == "__main__":
    main()
