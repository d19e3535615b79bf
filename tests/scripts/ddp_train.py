"""A training script started under every launcher in tests/test_ddp.py: each rank writes what it saw under --out."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import Portable, RegressionStream, Regressor, StepEndRegressor, regression_data  # noqa: E402

import lightning_mgpu  # noqa: E402
from lightning_mgpu.strategies.ddp import release_process_group_at_exit  # noqa: E402


class Data(L.LightningDataModule):
    """Rank r takes rows r, r + w, ...: per step the ranks together see the rows one device sees with batch w * b."""

    def __init__(self, batch: int, shuffle_by_lightning: bool, val_rows: int, stream: bool = False) -> None:
        super().__init__()
        self.batch = batch
        self.shuffle_by_lightning = shuffle_by_lightning
        self.val_rows = val_rows
        self.stream = stream

    def train_dataloader(self) -> DataLoader:
        if self.stream:  # an IterableDataset, which every rank reads whole: no sampler shards it
            return DataLoader(RegressionStream(), batch_size=self.batch)
        data = regression_data()
        if self.shuffle_by_lightning:
            indexed = TensorDataset(torch.arange(20.0).unsqueeze(1).repeat(1, 4), torch.zeros(20, 1))
            return DataLoader(indexed, batch_size=self.batch)
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=self.batch, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        data = regression_data(rows=self.val_rows, seed=3)
        if self.trainer.state.fn == "validate":
            return DataLoader(data, batch_size=2)  # Lightning adds its (padding) DistributedSampler
        # Under fit this script turns Lightning's samplers off, so it shards the data itself, padding included.
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=2, sampler=sampler)


class Evaluated(StepEndRegressor):
    """Logs, from validation_step_end, how many rows it saw and their summed error, synced across ranks."""

    def validation_step_end(self, errors: torch.Tensor) -> None:
        self.log("val_rows", float(errors.shape[0]), reduce_fx="sum", sync_dist=True)
        self.log("val_loss", errors.mean(), sync_dist=True)


class Unused(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.unused_head = torch.nn.Linear(4, 1)


class Recorder(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.rows.setdefault(trainer.current_epoch, []).extend(batch[0][:, 0].tolist())

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.write(trainer)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.write(trainer)

    def write(self, trainer: L.Trainer) -> None:
        rank = trainer.global_rank
        report = {
            "rank": rank,
            "world_size": trainer.world_size,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "strategy": type(trainer.strategy).__name__,
            "metrics": {key: value.item() for key, value in trainer.callback_metrics.items()},
            "rows": self.rows,
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(report))
        if rank == 0:
            torch.save(trainer.lightning_module.state_dict(), self.out / "params.pt")


class FailOnRank(L.Callback):
    def __init__(self, rank: int, exit_silently: bool) -> None:
        self.rank = rank
        self.exit_silently = exit_silently

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == 2:
            if self.exit_silently:
                os._exit(3)  # a crash that runs no Python clean-up, like the OOM killer
            raise RuntimeError(f"rank {self.rank} fails on purpose")


def report_at_exit(out: Path, trainer: L.Trainer) -> None:
    """Write, from the last exit handler to run, whether torch.distributed still has its default group."""

    def report() -> None:
        state = {"group_initialized": dist.is_available() and dist.is_initialized()}
        (out / f"exit-rank{trainer.global_rank}.json").write_text(json.dumps(state))

    atexit.register(report)  # before the run registers any handler, so it runs after all of them


MODELS = {"Regressor": Regressor, "StepEndRegressor": StepEndRegressor, "Evaluated": Evaluated, "Unused": Unused,
          "Portable": Portable}  # fmt: skip


def main() -> None:
    parser = lightning_mgpu.add_local_rank_argument(argparse.ArgumentParser())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="Regressor")
    parser.add_argument("--strategy", choices=["mgpu_ddp", "ddp"], default="mgpu_ddp")
    parser.add_argument("--scenario", choices=["fit", "validate", "shuffle", "fail", "exit"], default="fit")
    parser.add_argument("--stream", action="store_true", help="train on an IterableDataset, with Lightning's samplers")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--ckpt-in", type=Path)
    parser.add_argument("--val-rows", type=int, default=0)
    parser.add_argument("--exit-report", action="store_true", help="write exit-rank<R>.json when the process exits")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (
        args.out / f"pid-local{args.local_rank}-node{os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))}"
    ).write_text(str(os.getpid()))

    torch.set_num_threads(1)
    model = MODELS[args.model]()
    strategy_class = lightning_mgpu.MGPUDDPStrategy if args.strategy == "mgpu_ddp" else L.pytorch.strategies.DDPStrategy
    callbacks: list[L.Callback] = [Recorder(args.out)]
    if args.scenario in ("fail", "exit"):
        callbacks.append(FailOnRank(args.fail_rank, exit_silently=args.scenario == "exit"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy_class(timeout=timedelta(seconds=args.timeout)),
        max_epochs=args.epochs,
        use_distributed_sampler=args.scenario in ("shuffle", "validate") or args.stream,
        logger=False,
        enable_checkpointing=args.ckpt_in is None and args.scenario == "fit",
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        limit_val_batches=1.0 if args.val_rows else 0,
    )
    if args.exit_report:
        report_at_exit(args.out, trainer)
    if args.strategy == "ddp":
        release_process_group_at_exit()  # mgpu_ddp registers this itself; Lightning's ddp leaves gloo's threads running
    data = Data(args.batch, shuffle_by_lightning=args.scenario == "shuffle", val_rows=args.val_rows, stream=args.stream)
    if args.scenario == "validate":
        trainer.validate(model, datamodule=data, verbose=False)
    else:
        trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_in)


if __name__ == "__main__":
    main()
