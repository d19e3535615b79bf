"""The split-and-gather contract through a real Trainer: every batch and output below trains or predicts under
mgpu_dp exactly as on one device, or fails before the first step with the cause and the fix."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import pytest
import torch
from models import Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_mgpu import BatchSplitError, Fields, MGPUMixin, PerSample

BATCH = 4


class _Images(Dataset):
    """One feature row per image and a boxes tensor per image; the batches' box counts are chosen per test."""

    def __init__(self, box_counts: list[list[int]]) -> None:
        counts = [count for batch in box_counts for count in batch]
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(len(counts), 4, generator=generator)
        self.boxes = [torch.randn(count, 4, generator=generator) for count in counts]

    def __len__(self) -> int:
        return len(self.boxes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.boxes[index]


def _detection_collate(marked: bool) -> Any:
    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        boxes = [sample[1] for sample in samples]
        return {
            "images": torch.stack([sample[0] for sample in samples]),
            "boxes": PerSample(boxes) if marked else boxes,
        }

    return collate


class _BoxRegressor(L.LightningModule):
    """Predicts the mean box of each image: a replica that pairs an image with another image's boxes trains wrong."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        predicted = self.net(batch["images"])
        pairs = zip(predicted, batch["boxes"], strict=False)  # as loose as detection losses often are
        errors = [(row - boxes.mean(0)).pow(2).sum() for row, boxes in pairs]
        return torch.stack(errors).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_boxes(box_counts: list[list[int]], marked: bool, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    model = _BoxRegressor()
    data = DataLoader(_Images(box_counts), batch_size=BATCH, collate_fn=_detection_collate(marked))
    trainer(max_epochs=2, **trainer_kwargs).fit(model, data)
    return parameters(model)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize(
    ("box_counts", "marked"),
    [
        ([[1, 3, 2, 5], [4, 2, 4, 4], [3, 4, 4, 4]], False),
        ([[1, 3, 2, 5], [4, 4, 4, 4], [4, 4, 4, 4]], False),
        ([[4, 4, 4, 4], [1, 3, 2, 5], [4, 4, 4, 4]], True),
    ],
    ids=[
        "plain-list-whose-counts-tell-in-every-batch",
        "plain-list-whose-first-batch-tells-the-later-ones",
        "persample-with-n-boxes-per-image",
    ],
)
def test_one_boxes_tensor_per_image_trains_like_one_device(
    box_counts: list[list[int]], marked: bool, devices: int
) -> None:
    single = _fit_boxes(box_counts, marked)
    parallel = _fit_boxes(box_counts, marked, devices=devices, strategy="mgpu_dp")
    assert_same_parameters(single, parallel)
    assert not torch.equal(single["net.0.weight"], parameters(_BoxRegressor())["net.0.weight"])


def test_n_boxes_per_image_in_a_plain_list_are_refused_at_the_first_batch_with_the_path() -> None:
    """The list reads both as fields and per image, and no earlier batch tells: no step runs, no parameter moves."""
    stepped: list[int] = []

    class Recording(_BoxRegressor):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            stepped.append(batch_idx)
            return super().training_step(batch, batch_idx)

    model = Recording()
    before = parameters(model)
    data = DataLoader(_Images([[4, 4, 4, 4]]), batch_size=BATCH, collate_fn=_detection_collate(marked=False))
    with pytest.raises(BatchSplitError) as caught:
        trainer(devices=2, strategy="mgpu_dp").fit(model, data)
    assert caught.value.path == "batch['boxes']"
    assert stepped == []
    assert_same_parameters(before, parameters(model), atol=0)


def test_per_image_tensors_alone_at_the_top_of_the_batch_are_refused_before_the_first_step() -> None:
    """torch would chunk each tensor by its own rows; here they disagree on N, and the error names the odd one."""
    stepped: list[int] = []

    class Recording(_BoxRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            stepped.append(batch_idx)
            return super().training_step(batch, batch_idx)

    data = DataLoader(_Images([[1, 3, 2, 5]]), batch_size=BATCH, collate_fn=lambda rows: [row[1] for row in rows])
    with pytest.raises(BatchSplitError) as caught:
        trainer(devices=2, strategy="mgpu_dp").fit(Recording(), data)
    assert caught.value.path == "batch[1]"
    assert stepped == []


class _Named(Dataset):
    """Regression rows with a name each; the default collate gives ``[x, y, names]``, the names as a tuple."""

    def __init__(self, rows: int) -> None:
        self.x, self.y = regression_data(rows=rows).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        return self.x[index], self.y[index], f"row-{index}"


class _NamedRegressor(MGPUMixin, Regressor):
    """Returns the batch's names with its per-row errors; the hooks receive them gathered, in batch order."""

    def __init__(self) -> None:
        super().__init__()
        self.names_seen: list[list[str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, names = batch
        return {"errors": (self(x) - y).pow(2).squeeze(1), "names": names}

    def training_step_end(self, step_output: dict[str, Any]) -> torch.Tensor:
        self.names_seen.append(step_output["names"])
        return step_output["errors"].mean()

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, _, names = batch
        return {"prediction": self(x), "names": names}


@pytest.mark.parametrize("devices", [2, 3])
def test_names_returned_from_predict_step_come_back_in_batch_order(devices: int) -> None:
    data = DataLoader(_Named(rows=11), batch_size=BATCH)  # 4 + 4 + 3 rows: uneven chunks on 2 and 3 devices
    single = trainer().predict(_NamedRegressor(), data)
    parallel = trainer(devices=devices, strategy="mgpu_dp").predict(_NamedRegressor(), data)
    assert [output["names"] for output in parallel] == [output["names"] for output in single]
    assert parallel[2]["names"] == ("row-8", "row-9", "row-10")
    for left, right in zip(single, parallel, strict=True):
        torch.testing.assert_close(left["prediction"], right["prediction"], atol=1e-6, rtol=0)


def test_a_names_list_returned_alone_from_predict_step_is_concatenated() -> None:
    class NamesOnly(_NamedRegressor):
        def predict_step(self, batch: Any, batch_idx: int) -> tuple[str, ...]:
            return batch[2]

    data = DataLoader(_Named(rows=7), batch_size=5)  # chunks of 3 + 2, then 1 + 1
    predictions = trainer(devices=2, strategy="mgpu_dp").predict(NamesOnly(), data)
    assert predictions == [tuple(f"row-{index}" for index in range(5)), ("row-5", "row-6")]


@pytest.mark.parametrize("devices", [2, 3])
def test_names_gathered_for_training_step_end_train_like_one_device(devices: int) -> None:
    data = DataLoader(_Named(rows=11), batch_size=BATCH)
    single, parallel = _NamedRegressor(), _NamedRegressor()
    trainer(max_epochs=2).fit(single, data)
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(parallel, data)
    assert parallel.names_seen == single.names_seen
    assert_same_parameters(parameters(single), parameters(parallel))


@dataclass
class _WeightedRows:
    """A dataclass batch whose per-row weights are derived after ``__init__`` from the batch it was built for."""

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weight = torch.linspace(0.5, 1.5, len(self.x)).unsqueeze(1)


class _WeightedRegressor(Regressor):
    def training_step(self, batch: _WeightedRows, batch_idx: int) -> torch.Tensor:
        return (batch.weight * (self(batch.x) - batch.y).pow(2)).mean()


@pytest.mark.parametrize("devices", [2, 3])
def test_a_dataclass_batch_with_an_init_false_field_trains_like_one_device(devices: int) -> None:
    data = DataLoader(
        regression_data(rows=11), batch_size=BATCH, collate_fn=lambda rows: _WeightedRows(*default_collate(rows))
    )
    single, parallel = _WeightedRegressor(), _WeightedRegressor()
    trainer(max_epochs=2).fit(single, data)
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(parallel, data)
    assert_same_parameters(parameters(single), parameters(parallel))


@pytest.mark.parametrize("devices", [2, 3])
def test_a_two_row_pair_batch_at_the_end_of_an_epoch_trains_like_one_device(devices: int) -> None:
    data = loader(regression_data(rows=18), 8)  # [x, y] batches of 8, 8 and 2 rows
    single, parallel = Regressor(), Regressor()
    trainer(max_epochs=2).fit(single, data)
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(parallel, data)
    assert_same_parameters(parameters(single), parameters(parallel))
    assert not torch.equal(parameters(single)["net.0.weight"], parameters(Regressor())["net.0.weight"])


_PAIR_COLLATES: dict[str, Callable[[list[Any]], Any]] = {
    "list": default_collate,
    "tuple": lambda rows: tuple(default_collate(rows)),
    "fields": lambda rows: Fields(default_collate(rows)),
}


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("collate", list(_PAIR_COLLATES))
def test_a_tensor_dataset_in_batches_of_2_trains_like_one_device(collate: str, devices: int) -> None:
    data = DataLoader(regression_data(rows=6), batch_size=2, collate_fn=_PAIR_COLLATES[collate])
    single, parallel = Regressor(), Regressor()
    trainer(max_epochs=2).fit(single, data)
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(parallel, data)
    assert_same_parameters(parameters(single), parameters(parallel))
    assert not torch.equal(parameters(single)["net.0.weight"], parameters(Regressor())["net.0.weight"])


def test_a_tensor_dataset_of_alike_pairs_ending_in_2_rows_reads_its_last_batch_as_fields() -> None:
    """x and y are alike (4 x 1 floats), so the last [x, y] of 2 rows reads both ways; the batches of 4 rows tell."""
    data = loader(regression_data(rows=10, features=1), BATCH)  # [x, y] batches of 4, 4 and 2 rows
    single, parallel = Regressor(features=1), Regressor(features=1)
    trainer(max_epochs=2).fit(single, data)
    with warnings.catch_warnings(record=True) as caught:  # the suite's filters stay: Lightning's known warnings
        trainer(max_epochs=2, devices=2, strategy="mgpu_dp").fit(parallel, data)
    assert [str(warning.message) for warning in caught] == []
    assert_same_parameters(parameters(single), parameters(parallel))
    assert not torch.equal(parameters(single)["net.0.weight"], parameters(Regressor(features=1))["net.0.weight"])
