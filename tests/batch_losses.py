"""LightningModules whose ``*_step_end`` needs the whole batch: in-batch negatives, batch statistics, retrieval.

Each returns per-sample outputs from its steps and computes, in float64, a value over every row of the batch in its
``*_step_end`` hook, written for one device: SimCLR's NT-Xent on two views, CLIP's symmetric loss with a learnable
temperature, a VICReg variance/covariance/invariance loss, and the top-1 retrieval accuracy of every query against
every document of the batch (logged in ``validation_step_end``). ``MGPUMixin`` makes them run unchanged on one device,
under ``mgpu_dp`` and under ``mgpu_ddp(gather_step_end=True)``. The data is generated from a seed.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_mgpu import MGPUMixin


def views(rows: int, seed: int = 0) -> TensorDataset:
    """Two noisy views of each of ``rows`` samples (6 and 5 features), in float64."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 5, generator=generator, dtype=torch.float64)
    first = torch.cat([base, torch.randn(rows, 1, generator=generator, dtype=torch.float64)], dim=1)
    second = base + 0.3 * torch.randn(rows, 5, generator=generator, dtype=torch.float64)
    return TensorDataset(first, second)


class _WholeBatch(MGPUMixin, L.LightningModule):
    """A small encoder per view; every loss here compares each row with every other row of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.second = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        a, b = batch
        return {"a": self.first(a), "b": self.second(b)}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.loss(outputs["a"], outputs["b"])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


class NTXent(_WholeBatch):
    """SimCLR's normalized temperature-scaled cross entropy: each view's positive is the other view of its sample."""

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = a.shape[0]
        z = F.normalize(torch.cat([a, b]), dim=1)
        similarity = (z @ z.T / 0.5).masked_fill(torch.eye(2 * rows, dtype=torch.bool, device=z.device), -1e9)
        targets = torch.cat([torch.arange(rows, 2 * rows), torch.arange(rows)]).to(z.device)
        return F.cross_entropy(similarity, targets)


class CLIP(_WholeBatch):
    """CLIP's symmetric cross entropy over every image-text pair of the batch, with a learnable temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=torch.float64))

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        logits = self.logit_scale.exp() * F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
        labels = torch.arange(a.shape[0], device=a.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class VICReg(_WholeBatch):
    """Invariance, variance and covariance of the batch's embeddings (the batch statistics are the point)."""

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        invariance = F.mse_loss(a, b)
        variance = sum(F.relu(1 - torch.sqrt(z.var(dim=0) + 1e-4)).mean() for z in (a, b))
        covariance = sum(_off_diagonal_squares(z) for z in (a, b))
        return 25 * invariance + 25 * variance + covariance  # type: ignore[return-value]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.002, momentum=0.9)  # its terms are 25 times larger


def _off_diagonal_squares(z: torch.Tensor) -> torch.Tensor:
    centred = z - z.mean(dim=0)
    covariance = centred.T @ centred / (z.shape[0] - 1)
    return (covariance.pow(2).sum() - covariance.diagonal().pow(2).sum()) / z.shape[1]


class Retrieval(CLIP):
    """CLIP, validated by the top-1 accuracy of every query against every document of the validation batch, and tested
    by each query's rank among them."""

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        a, b = batch
        return {"queries": F.normalize(self.first(a), dim=1), "documents": F.normalize(self.second(b), dim=1)}

    def validation_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
        scores = outputs["queries"] @ outputs["documents"].T
        hits = scores.argmax(dim=1) == torch.arange(scores.shape[0], device=scores.device)
        self.log("val_retrieval_acc", hits.double().mean())

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return self.validation_step(batch, batch_idx)

    def test_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
        """The mean rank of each query's own document among every document of the batch (1 is best)."""
        scores = outputs["queries"] @ outputs["documents"].T
        own = scores.diagonal().unsqueeze(1)
        self.log("test_mean_rank", (scores > own).double().sum(dim=1).add(1).mean())


MODELS = {"nt_xent": NTXent, "clip": CLIP, "vicreg": VICReg, "retrieval": Retrieval}
