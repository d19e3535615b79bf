"""Plain lists where torch tells how the batch was built, compared with one device.

torch's ``default_collate`` transposes samples, so its lists hold fields (its lists of strings one per sample), and
``torch.nn.DataParallel`` splits a list among ``forward``'s inputs that reads both ways as fields: both are read so
without a marker. A ``collate_fn`` of one's own, or a loader without automatic batching, keeps the rule: an earlier
batch tells, else ``BatchSplitError`` asks for a marker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from models import (
    PLRegressor,
    Regressor,
    assert_same_parameters,
    parameters,
    pl_trainer,
    regression_data,
    trainer,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from lightning_mgpu import BatchSplitError, MGPUDataParallel, PerSample

CPU2 = [torch.device("cpu")] * 2
REPEATS = 2


class _Nested(Dataset):
    """Samples ``(x_i, (x_i, x_i))``: with 2 rows a batch's inner pair holds 2 alike tensors of 2 rows."""

    def __init__(self, rows: int = 6) -> None:
        self.x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.x[index], (self.x[index], self.x[index])


class _NestedModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        x, (a, b) = batch
        assert x.shape == a.shape == b.shape, "every tensor is split along dim 0"
        return (self.net(x) - self.net(a).tanh() - b.sum(1, keepdim=True)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _own_collate(samples: list[Any]) -> Any:
    return default_collate(samples)


@pytest.mark.parametrize(("model", "make_trainer"), [(Regressor, trainer), (PLRegressor, pl_trainer)])
def test_a_tensor_dataset_of_alike_pairs_in_batches_of_2_trains_like_one_device(
    model: Callable[..., Any], make_trainer: Callable[..., Any]
) -> None:
    data = DataLoader(regression_data(rows=6, features=1), batch_size=2)
    single = model(features=1)
    make_trainer(max_epochs=2).fit(single, data)
    assert not torch.equal(parameters(single)["net.0.weight"], parameters(model(features=1))["net.0.weight"])
    for _ in range(REPEATS):
        parallel = model(features=1)
        make_trainer(max_epochs=2, devices=2, strategy="mgpu_dp").fit(parallel, data)
        assert_same_parameters(parameters(single), parameters(parallel))


def test_default_collated_samples_holding_a_pair_train_like_one_device() -> None:
    data = DataLoader(_Nested(), batch_size=2)
    single = _NestedModel()
    initial = parameters(single)
    trainer(max_epochs=2).fit(single, data)
    assert not torch.equal(parameters(single)["net.weight"], initial["net.weight"])
    for _ in range(REPEATS):
        parallel = _NestedModel()
        trainer(max_epochs=2, devices=2, strategy="mgpu_dp").fit(parallel, data)
        assert_same_parameters(parameters(single), parameters(parallel))


@pytest.mark.parametrize(
    "data",
    [
        lambda: DataLoader(_Nested(), batch_size=2, collate_fn=_own_collate),
        lambda: DataLoader([default_collate([_Nested()[0], _Nested()[1]])], batch_size=None),
    ],
    ids=["own-collate-fn", "no-automatic-batching"],
)
def test_a_pair_of_alike_tensors_is_refused_where_torch_did_not_collate_the_batch(data: Any) -> None:
    model = _NestedModel()
    before = parameters(model)
    with pytest.raises(BatchSplitError) as caught:
        trainer(devices=2, strategy="mgpu_dp").fit(model, data())
    assert caught.value.path == "batch[1]"
    assert "holds 2 alike items whose tensors all have the batch's 2 rows" in str(caught.value)
    assert "no earlier batch told which" in str(caught.value)
    assert_same_parameters(before, parameters(model), atol=0)


def test_one_loader_with_its_own_collate_fn_keeps_the_rule_for_every_loader_of_the_stage() -> None:
    class Validated(_NestedModel):
        def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

    loaders = [DataLoader(_Nested(), batch_size=2), DataLoader(_Nested(), batch_size=2, collate_fn=_own_collate)]
    with pytest.raises(BatchSplitError) as caught:
        trainer(devices=2, strategy="mgpu_dp").validate(Validated(), loaders)
    assert caught.value.path == "batch[1]"


def test_a_batch_hook_that_rebuilds_the_batch_keeps_the_rule() -> None:
    class Hooked(_NestedModel):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return batch

    with pytest.raises(BatchSplitError) as caught:
        trainer(devices=2, strategy="mgpu_dp").fit(Hooked(), DataLoader(_Nested(), batch_size=2))
    assert caught.value.path == "batch[1]"


class _Named(Dataset):
    """Samples ``(x_i, ("a<i>", "b<i>"))``: collated, a list of 2 per-sample tuples of names, which hold no tensor."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple[str, str]]:
        return torch.full((1,), float(index)), (f"a{index}", f"b{index}")


def test_default_collated_names_reach_the_replica_of_their_rows() -> None:
    """Each tuple of names is one per sample; the list of them is fields, as default_collate built it."""
    seen: list[tuple[list[float], list[list[str]]]] = []

    class Names(_NestedModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(1, 1)

        def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
            x, names = batch
            seen.append((x.flatten().tolist(), [list(field) for field in names]))
            return self.net(x).pow(2).mean()

    trainer(devices=2, strategy="mgpu_dp").fit(Names(), DataLoader(_Named(), batch_size=2))
    assert sorted(seen) == [([float(row)], [[f"a{row}"], [f"b{row}"]]) for row in range(4)], (
        "replica i gets the names of its rows"
    )


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return self.net(x) * self.net(a).tanh() + b[:, :2]


def test_forward_splits_a_pair_of_alike_tensors_as_fields_like_torch() -> None:
    module = _Pair()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    expected = module(x, (x, x))
    wrapper = MGPUDataParallel(module, CPU2)
    try:
        for _ in range(REPEATS):
            torch.testing.assert_close(wrapper(x, (x, x)), expected, atol=1e-6, rtol=0)
    finally:
        wrapper.close()


def test_forward_still_splits_a_per_sample_list_by_items() -> None:
    class PerImage(nn.Module):
        def forward(self, images: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
            assert len(boxes) == len(images)
            return torch.stack([image.sum() - box.mean() for image, box in zip(images, boxes, strict=True)])

    images = torch.randn(2, 3)
    boxes = [torch.randn(2, 4), torch.randn(2, 4)]  # 2 alike tensors of 2 rows: fields unless marked
    wrapper = MGPUDataParallel(PerImage(), CPU2)
    try:
        torch.testing.assert_close(wrapper(images, PerSample(boxes)), PerImage()(images, boxes), atol=0, rtol=0)
    finally:
        wrapper.close()


def test_a_tensor_dataset_through_a_datamodule_without_batch_hooks_is_read_as_fields() -> None:
    class Pairs(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(*regression_data(rows=4, features=1).tensors), batch_size=2)

    single, parallel = Regressor(features=1), Regressor(features=1)
    trainer().fit(single, datamodule=Pairs())
    trainer(devices=2, strategy="mgpu_dp").fit(parallel, datamodule=Pairs())
    assert_same_parameters(parameters(single), parameters(parallel))


def test_a_shuffled_loader_recreated_around_its_sampler_keeps_default_collate() -> None:
    model = Regressor(features=1)
    data = DataLoader(regression_data(rows=6, features=1), batch_size=2, shuffle=True)
    fit = trainer(devices=2, strategy="mgpu_dp")
    fit.fit(model, data)
    assert fit.train_dataloader.collate_fn is default_collate
    assert not torch.equal(parameters(model)["net.0.weight"], parameters(Regressor(features=1))["net.0.weight"])
