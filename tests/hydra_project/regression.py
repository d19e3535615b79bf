"""The project's model and data: a linear regression on rows generated in the process, nothing downloaded."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class RegressionData(L.LightningDataModule):
    """``rows`` random rows; ``batch_size`` is the global batch, divided among the processes as the template does."""

    def __init__(self, rows: int = 64, features: int = 4, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.rows, self.features, self.batch_size, self.seed = rows, features, batch_size, seed
        self.batch_size_per_device = batch_size

    def setup(self, stage: str) -> None:
        world_size = 1 if self.trainer is None else self.trainer.world_size
        if self.batch_size % world_size:
            raise ValueError(f"batch_size {self.batch_size} does not divide into {world_size} processes")
        self.batch_size_per_device = self.batch_size // world_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.rows, self.features, generator=generator)
        y = x @ torch.randn(self.features, 1, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size_per_device, shuffle=False)


class RegressionModel(L.LightningModule):
    """One linear layer, trained on the mean squared error."""

    def __init__(self, features: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.layer = torch.nn.Linear(features, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
