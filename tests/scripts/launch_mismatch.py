"""Builds an ``mgpu_ddp`` Trainer with ``--devices``/``--num-nodes`` and fits a tiny model, under whatever launcher.

tests/test_launch_mismatch.py starts it with process counts that disagree with the Trainer: every rank must fail at
once with the launcher's and the Trainer's numbers, instead of waiting for ranks that do not exist.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = lightning_mgpu.add_local_rank_argument(argparse.ArgumentParser())
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        # A short collective timeout, so a check that failed to fire makes the test fail in a minute, not in 30.
        strategy=lightning_mgpu.MGPUDDPStrategy(timeout=timedelta(seconds=45)),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    trainer.fit(Tiny(), DataLoader(data, batch_size=2))
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
