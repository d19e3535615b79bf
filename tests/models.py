"""Small LightningModules and data shared by the tests, in both Lightning namespaces.

Each model's steps are written once without a Lightning base (``RegressorSteps``, ...) and bound to
``lightning.pytorch`` (``Regressor``, ...) and to ``pytorch_lightning`` (``PLRegressor``, ...), as the package binds
its strategies.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from lightning_mgpu import MGPUMixin


def regression_data(rows: int = 20, features: int = 4, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(rows, 1, generator=generator)
    return TensorDataset(x, y)


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


class RegressionDataSteps:
    """``regression_data`` for every stage, in batches of ``batch_size``."""

    def __init__(self, rows: int = 20, batch_size: int = 4) -> None:
        super().__init__()
        self.rows = rows
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return loader(regression_data(self.rows), self.batch_size)

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


class RegressionData(RegressionDataSteps, L.LightningDataModule):
    """``RegressionDataSteps`` on ``lightning.pytorch``."""


class PLRegressionData(RegressionDataSteps, pl.LightningDataModule):
    """``RegressionDataSteps`` on ``pytorch_lightning``."""


class RegressorSteps:
    """Returns the scalar mean loss from each replica: the default weighted-mean reduction applies."""

    def __init__(self, features: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Regressor(RegressorSteps, L.LightningModule):
    """``RegressorSteps`` on ``lightning.pytorch``."""


class PLRegressor(RegressorSteps, pl.LightningModule):
    """``RegressorSteps`` on ``pytorch_lightning``."""


class StepEndSteps(RegressorSteps):
    """Returns per-sample errors from the replicas and reduces them in the ``*_step_end`` hooks, as 1.x DP code did."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"errors": (self(x) - y).pow(2).squeeze(1), "rows": torch.tensor(x.shape[0])}

    def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = step_output["errors"].mean()
        self.log("train_loss", loss)
        self.log("rows_seen", step_output["rows"].sum().float(), reduce_fx="sum", on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) - y).pow(2).squeeze(1)

    def validation_step_end(self, errors: torch.Tensor) -> None:
        self.log("val_loss", errors.mean(), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) - y).pow(2).squeeze(1)

    def test_step_end(self, errors: torch.Tensor) -> None:
        self.log("test_loss", errors.mean())


class StepEndRegressor(StepEndSteps, Regressor):
    """``StepEndSteps`` on ``lightning.pytorch``."""


class PLStepEndRegressor(StepEndSteps, PLRegressor):
    """``StepEndSteps`` on ``pytorch_lightning``."""


def trainer(tmp_path: Any = None, trainer_class: type[Any] = L.Trainer, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    if tmp_path is not None:
        settings["default_root_dir"] = str(tmp_path)
    settings.update(overrides)
    return trainer_class(**settings)


def pl_trainer(tmp_path: Any = None, **overrides: Any) -> pl.Trainer:
    """``trainer``'s settings in a ``pytorch_lightning.Trainer``."""
    return trainer(tmp_path, pl.Trainer, **overrides)


def parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def assert_same_parameters(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=atol, rtol=0, msg=f"parameter {name} differs")


class PortableSteps:
    """The user's target: per-sample outputs from the step, the loss in training_step_end, under any strategy."""

    def __init__(self, features: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr = lr
        self.step_end_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"errors": (self(x) - y).pow(2).squeeze(1)}

    def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
        self.step_end_calls += 1
        loss = step_output["errors"].mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) - y).pow(2).squeeze(1)

    def validation_step_end(self, errors: torch.Tensor) -> None:
        self.log("val_loss", errors.mean(), sync_dist=True)
        self.log("val_rows", float(errors.shape[0]), reduce_fx="sum", sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Portable(MGPUMixin, PortableSteps, L.LightningModule):
    """``PortableSteps`` on ``lightning.pytorch``."""


class PLPortable(MGPUMixin, PortableSteps, pl.LightningModule):
    """``PortableSteps`` on ``pytorch_lightning``."""


class PositionKeepingLoader(DataLoader):
    """Keeps its place in the epoch by Lightning's ``state_dict``/``load_state_dict`` protocol, as torchdata's does.

    It stores the batches it yielded this epoch and the seed of its shuffled order, and after ``load_state_dict`` its
    next epoch repeats that order from the first batch not yet yielded.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self.seed: int | None = None
        self.loaded: dict[str, Any] | None = None

    def __iter__(self) -> Any:
        loaded, self.loaded = self.loaded, None
        skip = loaded["yielded"] if loaded else 0
        if isinstance(self.sampler, RandomSampler):
            self.seed = loaded["seed"] if loaded else int(torch.empty((), dtype=torch.int64).random_().item())
            self.sampler.generator = torch.Generator().manual_seed(self.seed)
        self.yielded = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.yielded = index + 1
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class RegressionStream(IterableDataset):
    """``regression_data``'s rows as a stream: an IterableDataset without a length, read from its first row."""

    def __init__(self, rows: int = 20) -> None:
        self.x, self.y = regression_data(rows)[:]
        self.position = 0
        """The rows yielded so far in the running iteration."""
        self.start = 0
        """Where the next iteration starts."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.start = self.start, 0
        for row in range(start, len(self.x)):
            self.position = row + 1
            yield self.x[row], self.y[row]


class SizedRegressionStream(RegressionStream):
    """A ``RegressionStream`` that states its length, so Lightning knows where each epoch ends before it gets there."""

    def __len__(self) -> int:
        return len(self.x)


class StatefulRegressionStream(RegressionStream):
    """Keeps its position by the ``state_dict``/``load_state_dict`` protocol; the next iteration resumes there."""

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]


class SizedStatefulRegressionStream(StatefulRegressionStream, SizedRegressionStream):
    """A ``StatefulRegressionStream`` that states its length."""


class DatasetStateLoader(DataLoader):
    """Checkpoints its dataset's position as its own state, as torchdata's ``StatefulDataLoader`` does."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined, no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


class DictBacked(Mapping[str, Any]):
    """A Mapping of one's own, as a step or a ``collate_fn`` may return: its items live in the dict it is given."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class KeywordsOnly(DictBacked):
    """A Mapping built from keyword arguments only, so no call with a dict or with pairs can rebuild it."""

    def __init__(self, *, loss: Any, errors: Any) -> None:
        super().__init__({"loss": loss, "errors": errors})


def image_data(rows: int, seed: int = 0) -> TensorDataset:
    """``rows`` float64 two-channel 6x6 images with a target each, for ``BatchNormNet``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2, 6, 6, generator=generator, dtype=torch.float64)
    y = x.mean((1, 2, 3)).unsqueeze(1) * 3 + 0.1 * torch.randn(rows, 1, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


class BatchNormNet(L.LightningModule):
    """Convolutions with ``BatchNorm2d`` and ``BatchNorm1d`` (a cumulative average: ``momentum=None``), in float64.

    ``BatchNorm1d`` normalises ``(rows, channels, length)``, so one row still has several values per channel: a step
    whose only row is one rank's trains on one device too. ``layer_types`` records the class of each BatchNorm layer
    while training runs.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv2d = nn.Conv2d(2, 4, 3)
        self.norm2d = nn.BatchNorm2d(4)
        self.conv1d = nn.Conv1d(4, 3, 3)
        self.norm1d = nn.BatchNorm1d(3, momentum=None)
        self.head = nn.Linear(3, 1)
        self.double()
        self.layer_types: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm2d(self.conv2d(x))).flatten(2)
        x = torch.tanh(self.norm1d(self.conv1d(x)))
        return self.head(x.mean(2))

    def on_train_start(self) -> None:
        self.layer_types = [type(self.norm2d).__name__, type(self.norm1d).__name__]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
