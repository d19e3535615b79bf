"""LightningModules with (and without) multi-GPU traps, and a small datamodule, for tests/test_doctor.py.

A module of its own so that ``lightning-mgpu doctor --model tests/doctor_models.py:BatchNormNet`` can load them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

Batch = tuple[torch.Tensor, torch.Tensor]


class ProbeData(L.LightningDataModule):
    """``rows`` samples of ``(x, y)`` with 4 features, in one batch by default."""

    def __init__(self, rows: int = 8, batch_size: int = 8) -> None:
        super().__init__()
        self.rows = rows
        self.batch_size = batch_size
        self.dataset: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.rows, 4, generator=generator)
        self.dataset = TensorDataset(x, x.sum(1, keepdim=True) + torch.randn(self.rows, 1, generator=generator))

    def train_dataloader(self) -> DataLoader:
        assert self.dataset is not None
        return DataLoader(self.dataset, batch_size=self.batch_size)


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CleanNet(_Net):
    """Per-sample values from the replicas; the loss in training_step_end. Nothing to find."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Dropout(0.5), nn.Linear(hidden, 1))

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self.layer(x).squeeze(1)
        return {"preds": preds, "errors": (preds - y.squeeze(1)).pow(2)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss = output["errors"].mean()
        self.log("train_loss", loss)
        return {"loss": loss, "preds": output["preds"]}


class MeanLossNet(_Net):
    """A scalar mean loss per replica, no step_end: mgpu_dp's chunk-weighted mean makes it exact."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss


class BatchNormNet(_Net):
    """BatchNorm inside the step: each replica normalises its chunk by the chunk's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.layer(x) - y).pow(2).squeeze(1)

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.mean()


class _BatchNormThenReLU(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class BatchNormSubclassNet(BatchNormNet):
    """A BatchNorm subclass whose forward also activates, as timm's BatchNormAct2d does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, 8), _BatchNormThenReLU(8), nn.Linear(8, 1))


class _HandMadeBatchNorm(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean(0), x.var(0, unbiased=False)
        with torch.no_grad():
            self.running_mean.lerp_(mean, 0.1)
        return (x - mean) / (var + self.eps).sqrt() * self.weight + self.bias


class HandMadeBatchNormNet(BatchNormNet):
    """A BatchNorm subclass that normalises by statistics of its own, not through torch's batch-norm function."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, 8), _HandMadeBatchNorm(8), nn.Linear(8, 1))


class CenteredNet(_Net):
    """Subtracts the batch mean inside training_step; the loss itself is per-sample and fine."""

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self.layer(x).squeeze(1)
        return {"errors": (preds - y.squeeze(1)).pow(2), "centered": preds - preds.mean()}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": output["errors"].mean(), "centered": output["centered"].detach()}


class BatchNormalisedLossNet(_Net):
    """Divides the loss by a batch statistic inside training_step: loss and gradients change when split."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        errors = (self.layer(x) - y).pow(2)
        return errors.sum() / y.var()


class ListParamsNet(_Net):
    """Parameters in a plain Python list: not registered, so not replicated, trained or saved."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = [nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))]

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x) * self.scales[0] * self.scales[1], y)


class MetricsByNameNet(_Net):
    """Metrics registered under their own names and indexed by name in a plain dict, updated in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = torchmetrics.MeanSquaredError()
        self.mae = torchmetrics.MeanAbsoluteError()
        self.metrics = {"mse": self.mse, "mae": self.mae}

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        prediction = self.layer(x)
        for metric in self.metrics.values():
            metric.update(prediction.detach(), y)
        return F.mse_loss(prediction, y)


class UnusedParamNet(MeanLossNet):
    """A head that the step never uses: no gradient, which DDP refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 2)


class StringOutputNet(_Net):
    """Returns a string next to the loss: replicas' outputs cannot be gathered."""

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"loss": F.mse_loss(self.layer(x), y), "note": "fine on one device"}


class ParametersInStepNet(_Net):
    """Adds a weight penalty over self.parameters() inside the step, where a replica yields its own parameters."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = sum(parameter.pow(2).sum() for parameter in self.parameters())
        return F.mse_loss(self.layer(x), y) + 0.01 * penalty


class RandomShiftNet(CleanNet):
    """Shifts the inputs by one random draw per call: random outside nn.Dropout, and per-sample otherwise."""

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return super().training_step((x + torch.randn(1), y), batch_idx)


class NormalisedPredNet(_Net):
    """Normalises ``pred`` by the batch's mean and deviation inside the step and passes ``y`` through."""

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        pred = self.layer(x).squeeze(1)
        return {"pred": (pred - pred.mean()) / pred.std(), "y": y.squeeze(1)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(output["pred"], output["y"])


class ChunkStatisticsBufferNet(_Net):
    """Per-sample outputs, but the step counts its rows in place and reassigns a running mean of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("input_mean", torch.zeros(4))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.rows_seen += x.shape[0]
        self.input_mean = 0.9 * self.input_mean + 0.1 * x.mean(0)
        return (self.layer(x) - y).pow(2).squeeze(1)

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.mean()


class RowCountBufferNet(_Net):
    """Counts its rows in a buffer, in place: alike in chunks of equal size, so only the doctor shows it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.rows_seen += x.shape[0]
        return (self.layer(x) - y).pow(2).mean()


class EncoderPenaltyNet(L.LightningModule):
    """Adds a weight penalty over ``self.encoder.parameters()`` inside the step; the loss is a mean per replica."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = sum(parameter.pow(2).sum() for parameter in self.encoder.parameters())
        return F.mse_loss(self.head(self.encoder(x)), y) + 0.01 * penalty

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepAttributeNet(_Net):
    """Stores the batch's row count on self in training_step and divides by it in training_step_end."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 1

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.rows = x.shape[0]
        return (self.layer(x) - y).pow(2).squeeze(1)

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.sum() / self.rows


class ScaledGradientNet(_Net):
    """Per-sample values, but their gradient is divided by the standard deviation of the chunk's targets."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.layer(x)
        pred = pred.detach() + (pred - pred.detach()) / y.std()
        return (pred - y).pow(2).squeeze(1)

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.mean()


class ChunkMeanLossNet(_Net):
    """Returns each replica's mean loss; training_step_end averages them, which is exact for equal chunks only."""

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.layer(x), y)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        return output["loss"].mean()


class CountMeanLossNet(_Net):
    """A loss that is a mean over the rows with a positive target, not over all rows: a token-style mean.

    With ``weighted``, the step states that count as ``loss_weight``, which makes mgpu_dp's combination exact.
    """

    def __init__(self, weighted: bool = False) -> None:
        super().__init__()
        self.weighted = weighted

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        counted = (y > 0).squeeze(1)
        loss = (self.layer(x) - y).pow(2).squeeze(1)[counted].mean()
        return {"loss": loss, "loss_weight": counted.sum()} if self.weighted else {"loss": loss}


class InBatchNegativesNet(L.LightningModule):
    """A contrastive loss computed in training_step: each row's positive scored against the batch's other rows."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(4, 3)
        self.right = nn.Linear(1, 3)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = F.normalize(self.left(x), dim=1) @ F.normalize(self.right(y), dim=1).T * 5
        return F.cross_entropy(logits, torch.arange(len(x)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ClipNet(L.LightningModule):
    """Two encoders and CLIP's symmetric contrastive loss in training_step_end: every row's negatives are the others.

    ``validation_step_end`` logs the in-batch retrieval recall, a metric over the batch too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(4, 3)
        self.text = nn.Linear(1, 3)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"image": F.normalize(self.image(x), dim=1), "text": F.normalize(self.text(y), dim=1)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = output["image"] @ output["text"].T * self.logit_scale.exp()
        labels = torch.arange(len(logits))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return self.training_step(batch, batch_idx)

    def validation_step_end(self, output: dict[str, torch.Tensor]) -> None:
        logits = output["image"] @ output["text"].T
        recall = (logits.argmax(1) == torch.arange(len(logits))).float().mean()
        self.log("val_recall", recall)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MeanErrorsNet(_Net):
    """Per-sample errors from the step; training_step_end and validation_step_end take and log their mean.

    With ``reduction="sum"`` the training loss is their sum, which under DDP's averaging of gradients shrinks by the
    number of ranks.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.layer(x) - y).pow(2).squeeze(1)

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        loss = errors.sum() if self.reduction == "sum" else errors.mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def validation_step_end(self, errors: torch.Tensor) -> None:
        self.log("val_loss", errors.mean())


class HardestErrorsNet(MeanErrorsNet):
    """training_step_end averages the 5 largest errors of the batch: more rows than a rank's share of 8 holds."""

    def training_step_end(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.topk(5).values.mean()
