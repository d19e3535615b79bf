"""Code written for Lightning 1.x's ``strategy="dp"`` runs under ``mgpu_dp`` with one added import.

The first part covers what such code calls: ``self.trainer.strategy.reduce`` in ``training_step_end``, ``self.log``'s
``reduce_fx`` inside the step, and ``devices=1``. The second part ports Lightning 1.9.5's own tests of the ``dp``
strategy and of the ``*_step_end`` hooks to virtual CPU replicas, named after the test they come from.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import Regressor, StepEndRegressor, assert_same_parameters, loader, parameters, regression_data, trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_mgpu import Fields, GatherError, MGPUDPStrategy
from lightning_mgpu.engine.reduce import reduce_op_name
from lightning_mgpu.step.replica_log import reduction


def _fit(model: L.LightningModule, batch_size: int, **trainer_kwargs: Any) -> L.Trainer:
    fitted = trainer(**trainer_kwargs)
    fitted.fit(model, loader(regression_data(), batch_size))
    return fitted


# --- self.trainer.strategy.reduce ------------------------------------------------------------------------------


class _ReducesInStepEnd(Regressor):
    """1.x DP code: each replica's mean loss, averaged in ``training_step_end`` by the strategy."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": nn.functional.mse_loss(self(x), y)}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.trainer.strategy.reduce(outputs["loss"])


def test_strategy_reduce_in_training_step_end_trains_as_one_device() -> None:
    single, parallel = Regressor(), _ReducesInStepEnd()
    _fit(single, 4, max_epochs=2)
    _fit(parallel, 4, max_epochs=2, devices=2, strategy="mgpu_dp")  # 2 + 2 rows: the plain mean is exact
    assert_same_parameters(parameters(single), parameters(parallel))


def test_strategy_reduce_averages_every_tensor_like_lightning_1x() -> None:
    reduce = MGPUDPStrategy().reduce
    assert reduce(torch.tensor([1.0, 2.0, 6.0])).item() == 3.0
    averaged_ints = reduce(torch.tensor([1, 2]))
    assert (averaged_ints.dtype, averaged_ints.item()) == (torch.int64, 1), "in float, cast back, as in 1.x"
    scalar = torch.tensor(5.0)
    assert reduce(scalar) is scalar
    collection = reduce({"loss": torch.tensor([1.0, 3.0]), "parts": [torch.tensor([[2.0], [4.0]])], "name": "x"})
    assert collection["loss"].item() == 2.0
    assert collection["parts"][0].item() == 3.0
    assert collection["name"] == "x"


@pytest.mark.parametrize(
    ("reduce_op", "expected"),
    [(None, 2.0), ("mean", 2.0), ("AVG", 2.0), ("sum", 4.0), ("SUM", 4.0), ("max", 3.0), ("Min", 1.0)],
)
def test_strategy_reduce_follows_reduce_op(reduce_op: Any, expected: float) -> None:
    assert MGPUDPStrategy().reduce(torch.tensor([1.0, 3.0]), reduce_op=reduce_op).item() == expected


def test_strategy_reduce_takes_torch_reduce_ops_and_refuses_others() -> None:
    reduce = MGPUDPStrategy().reduce
    assert reduce(torch.tensor([1.0, 3.0]), reduce_op=torch.distributed.ReduceOp.SUM).item() == 4.0
    with pytest.raises(ValueError, match=r"reduce_op='product'\) under mgpu_dp: use 'mean'"):
        reduce(torch.tensor([1.0, 3.0]), reduce_op="product")
    strategy = MGPUDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.reduce_boolean_decision(True), "Lightning's own use: a 0-dim sum"
    assert not strategy.reduce_boolean_decision(False)


@pytest.mark.parametrize(
    ("reduce_op", "meaning"),
    [
        ("mean", "mean"),
        ("AVG", "mean"),
        ("Sum", "sum"),
        ("max", "max"),
        ("MIN", "min"),
        (torch.distributed.ReduceOp.AVG, "mean"),
        (torch.distributed.ReduceOp.SUM, "sum"),
        (torch.distributed.ReduceOp(torch.distributed.ReduceOp.MAX), "max"),
        (torch.distributed.ReduceOp.MIN, "min"),
        ("product", None),
        (torch.distributed.ReduceOp.PRODUCT, None),
        (0, None),
    ],
)
def test_one_reading_of_reduce_ops_serves_both_strategies_and_replica_logs(reduce_op: Any, meaning: str | None) -> None:
    assert reduce_op_name(reduce_op) == meaning
    values = torch.tensor([1.0, 3.0])
    expected = {"mean": 2.0, "sum": 4.0, "max": 3.0, "min": 1.0}
    if meaning is None:
        with pytest.raises(ValueError, match="under mgpu_dp"):
            MGPUDPStrategy().reduce(values, reduce_op=reduce_op)
    else:
        assert MGPUDPStrategy().reduce(values, reduce_op=reduce_op).item() == expected[meaning]
    if isinstance(reduce_op, str):
        if meaning is None:
            with pytest.raises(MisconfigurationException):
                reduction("loss", reduce_op, 0)
        else:
            assert reduction("loss", reduce_op, 0) == meaning


# --- self.log(..., reduce_fx=...) in replicas -------------------------------------------------------------------

# Replica 0 sees 3 rows of the batch of 5 and logs 3.0; replica 1 logs 2.0.
_ROWS_COMBINED = {"sum": 5.0, "max": 3.0, "min": 2.0, "mean": (3 * 3.0 + 2 * 2.0) / 5}


@pytest.mark.parametrize(
    ("reduce_fx", "meaning"),
    [
        ("SUM", "sum"),
        ("Sum", "sum"),
        (sum, "sum"),
        (torch.sum, "sum"),
        ("Max", "max"),
        (max, "max"),
        (torch.max, "max"),
        ("MIN", "min"),
        (min, "min"),
        (torch.min, "min"),
        ("MEAN", "mean"),
        ("Avg", "mean"),
        (torch.mean, "mean"),
    ],
)
def test_log_reduce_fx_in_replicas_takes_what_lightning_takes(reduce_fx: Any, meaning: str) -> None:
    class Logs(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("rows", float(batch[0].shape[0]), reduce_fx=reduce_fx, on_step=True, on_epoch=False)
            return super().training_step(batch, batch_idx)

    metrics = _fit(Logs(), 5, devices=2, strategy="mgpu_dp", max_steps=1).callback_metrics
    assert metrics["rows"].item() == pytest.approx(_ROWS_COMBINED[meaning], abs=1e-6)


@pytest.mark.parametrize(
    "reduce_fx",
    ["median", torch.median, lambda values: values.sum(), None],
    ids=["median", "torch.median", "f", "None"],
)
def test_log_reduce_fx_that_lightning_rejects_is_rejected_in_replicas(reduce_fx: Any) -> None:
    class Logs(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("value", 1.0, reduce_fx=reduce_fx)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=r"reduce_fx=\{min,max,mean,sum\}"):
        _fit(Logs(), 4, max_steps=1)
    with pytest.raises(MisconfigurationException, match=r"reduce_fx=\{min,max,mean,sum\}") as raised:
        _fit(Logs(), 4, devices=2, strategy="mgpu_dp", max_steps=1)  # Lightning's own message, at the replica's call
    assert any("raised in replica" in note for note in getattr(raised.value, "__notes__", []))


# --- devices=1 --------------------------------------------------------------------------------------------------


class _Keeps(StepEndRegressor):
    """Assigns attributes in its steps and returns strings, which no replica could hand back."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_seen = 0
        self.threads: set[str] = set()
        self.notes: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.steps_seen += 1
        self.threads.add(threading.current_thread().name)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"errors": super().validation_step(batch, batch_idx), "note": f"batch {batch_idx}"}

    def validation_step_end(self, outputs: dict[str, Any]) -> None:
        self.notes.append(outputs["note"])
        super().validation_step_end(outputs["errors"])

    def predict_step(self, batch: Any, batch_idx: int) -> str:
        return f"batch {batch_idx}"


def test_one_device_runs_the_module_itself() -> None:
    model = _Keeps()
    fitted = trainer(devices=1, strategy="mgpu_dp", max_epochs=1)
    fitted.fit(model, loader(regression_data(), 4), loader(regression_data(rows=7, seed=3), 3))

    assert isinstance(fitted.strategy, MGPUDPStrategy)
    assert fitted.model is model
    assert model.steps_seen == 5, "what the step assigns to self stays"
    assert model.threads == {threading.current_thread().name}
    assert model.notes == ["batch 0", "batch 1", "batch 2"], "strings reach *_step_end as they are"
    predictions = trainer(devices=1, strategy="mgpu_dp").predict(model, loader(regression_data(rows=6), 4))
    assert predictions == ["batch 0", "batch 1"]


def test_one_device_trains_as_lightning_single_device_and_as_two_devices() -> None:
    single, one, two = Regressor(), StepEndRegressor(), StepEndRegressor()
    single_run = _fit(single, 4, max_epochs=2)
    one_run = _fit(one, 4, max_epochs=2, devices=1, strategy="mgpu_dp")
    _fit(two, 4, max_epochs=2, devices=2, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(one))
    assert_same_parameters(parameters(single), parameters(two))
    torch.testing.assert_close(
        one_run.callback_metrics["train_loss"], single_run.callback_metrics["train_loss"], atol=1e-6, rtol=0
    )


def test_one_device_log_and_manual_backward_are_lightnings_own() -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()

    single, manual = Regressor(), Manual()
    _fit(single, 4, max_epochs=2)
    _fit(manual, 4, max_epochs=2, devices=1, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(manual))

    class Median(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("value", 1.0, reduce_fx="median")
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=r"^Only `self\.log\(\.\.\., reduce_fx=\{min,max,mean,sum\}"):
        _fit(Median(), 4, devices=1, strategy="mgpu_dp", max_steps=1)


def test_one_device_keeps_the_stop_iteration_and_loss_checks() -> None:
    class Exhausted(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            next(iter(nn.Identity().parameters()))
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match=r"StopIteration was raised inside training_step.*next\(\)"):
        _fit(Exhausted(), 4, devices=1, strategy="mgpu_dp", max_steps=1)

    class Diverges(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) * float("nan")

    with pytest.warns(UserWarning, match=r"mgpu_dp: the training loss is nan at step 0\. "):
        _fit(Diverges(), 4, devices=1, strategy="mgpu_dp", max_steps=1)


# --- Lightning 1.9.5's tests, ported --------------------------------------------------------------------------


class _Boring(L.LightningModule):
    """A linear layer pulled towards ones on random rows: the model Lightning's own tests train, in our words."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        output = self(batch)
        return nn.functional.mse_loss(output, torch.ones_like(output))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return {"loss": self.loss(batch)}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return {"x": self.loss(batch)}

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return {"y": self.loss(batch)}

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return _random_rows(64, batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return _random_rows(64, batch_size=2)

    def test_dataloader(self) -> DataLoader:
        return _random_rows(64, batch_size=2)


def _random_rows(rows: int, batch_size: int = 2, seed: int = 0) -> DataLoader:
    return DataLoader(torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)), batch_size=batch_size)


def _blobs(rows: int, seed: int) -> TensorDataset:
    """Three well separated Gaussian blobs in the plane, labelled by blob."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(rows) % 3
    centres = torch.tensor([[0.0, 4.0], [4.0, -2.0], [-4.0, -2.0]])
    return TensorDataset(centres[labels] + torch.randn(rows, 2, generator=generator), labels)


class _Classifier(L.LightningModule):
    """A classifier whose accuracy is computed on the whole batch in ``*_step_end``, as 1.x DP code did."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"logits": self(x), "y": y}

    def validation_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
        self.log("val_acc", self.val_acc(outputs["logits"], outputs["y"]))

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return self.validation_step(batch, batch_idx)

    def test_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
        self.log("test_acc", self.test_acc(outputs["logits"], outputs["y"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_multi_gpu_early_stop_dp_and_running_test_pretrained_model_distrib_dp(tmp_path: Path) -> None:
    """strategies/test_dp.py, models/test_restore.py and strategies/test_common.py (``test_evaluate``)."""
    train, val = DataLoader(_blobs(240, 0), batch_size=16), DataLoader(_blobs(60, 1), batch_size=16)
    model = _Classifier()
    before = parameters(model)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_acc", mode="max")
    stopper = EarlyStopping(monitor="val_acc", mode="max", patience=1)
    fitted = trainer(
        devices=2, strategy="dp", max_epochs=30, enable_checkpointing=True, callbacks=[checkpoint, stopper]
    )
    fitted.fit(model, train, val)
    assert 0 < stopper.stopped_epoch < 29
    assert any(not torch.equal(before[name], value) for name, value in parameters(model).items())

    pretrained = _Classifier.load_from_checkpoint(checkpoint.best_model_path)
    weights = parameters(pretrained)
    test = DataLoader(_blobs(90, 2), batch_size=16)
    split = trainer(devices=2, strategy="mgpu_dp").test(pretrained, test, verbose=False)[0]["test_acc"]
    trainer(devices=2, strategy="mgpu_dp").validate(pretrained, val, verbose=False)
    assert_same_parameters(weights, parameters(pretrained), atol=0)
    one_device = trainer(devices=1, strategy="dp").test(pretrained, test, verbose=False)[0]["test_acc"]
    assert split == pytest.approx(one_device, abs=1e-6)
    assert split > 0.9


def test_multi_gpu_model_dp(tmp_path: Path) -> None:
    """strategies/test_dp.py: the 1.x test model trains under ``dp``, and its checkpoint loads."""
    settings = {"max_epochs": 1, "limit_train_batches": 10, "limit_val_batches": 10}
    single, parallel = _Boring(), _Boring()
    trainer(**settings).fit(single)
    fitted = trainer(devices=2, strategy="dp", **settings)
    fitted.fit(parallel)
    assert_same_parameters(parameters(single), parameters(parallel))
    assert not torch.equal(parameters(_Boring())["layer.weight"], parameters(parallel)["layer.weight"])
    fitted.save_checkpoint(tmp_path / "model.ckpt")
    assert_same_parameters(parameters(_Boring.load_from_checkpoint(tmp_path / "model.ckpt")), parameters(parallel))


class _ExtraOutputs(_Boring):
    """Adds a float that names the replica to every step's output (and an int, if asked), and records what Lightning
    gets."""

    def __init__(self, with_int: bool = False) -> None:
        super().__init__()
        self.with_int = with_int
        self.received: dict[str, Any] = {}

    def _with_extras(self, output: dict[str, Any]) -> dict[str, Any]:
        output["reduce_float"] = torch.tensor(self.replica_index, dtype=torch.float, device=self.device)
        if self.with_int:
            output["reduce_int"] = torch.tensor(self.replica_index, dtype=torch.int, device=self.device)
        return output

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return self._with_extras(super().training_step(batch, batch_idx))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return self._with_extras(super().validation_step(batch, batch_idx))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        return self._with_extras(super().test_step(batch, batch_idx))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.received["train"] = outputs

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.received["val"] = outputs

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.received["test"] = outputs


def test_dp_training_step_dict() -> None:
    """strategies/test_dp.py: without ``*_step_end`` every 0-dim output is one value, as 1.x's validation reduced all.

    1.x reduced only the training loss and left other training outputs per device; here every 0-dim float is the
    mean weighted by each replica's rows (batches of 2 rows: one each, so the plain mean), in every loop.
    """
    model = _ExtraOutputs()
    run = trainer(devices=2, strategy="dp", fast_dev_run=True)
    run.fit(model)
    run.test(model, verbose=False)
    received = model.received
    assert received["train"]["loss"].shape == torch.Size([])
    assert received["val"]["x"].shape == torch.Size([])
    assert received["test"]["y"].shape == torch.Size([])
    for outputs in received.values():
        assert torch.equal(outputs["reduce_float"], torch.tensor(0.5))
        assert outputs["reduce_float"].dtype is torch.float


@pytest.mark.parametrize("run", ["fit", "test"])
def test_an_integer_output_without_step_end_is_refused_naming_it(run: str) -> None:
    """1.x averaged an int in float and cast it back; a count is no mean, so mgpu_dp stops and names it."""
    model = _ExtraOutputs(with_int=True)
    with pytest.raises(GatherError) as caught:
        getattr(trainer(devices=2, strategy="dp", fast_dev_run=True), run)(model)
    assert caught.value.path == "output['reduce_int']"
    hook = "training_step_end" if run == "fit" else "test_step_end"
    assert hook in str(caught.value)


def test_dp_batch_not_moved_to_device_explicitly() -> None:
    """strategies/test_dp.py, in part: hooks see the whole batch on the root device, each replica its own rows.

    1.x's hooks saw the batch where the DataLoader left it; mgpu_dp moves it to the root device first.
    """
    seen: list[tuple[str, tuple[int, ...], torch.device]] = []

    class Sees(_Boring):
        def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
            seen.append(("hook", tuple(batch.shape), batch.device))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            seen.append(("step", tuple(batch.shape), batch.device))
            return super().training_step(batch, batch_idx)

    trainer(devices=2, strategy="dp", fast_dev_run=True).fit(Sees())
    root = torch.device("cpu")
    assert sorted(seen, key=str) == [("hook", (2, 32), root), ("step", (1, 32), root), ("step", (1, 32), root)]


def test_dp_resume(tmp_path: Path) -> None:
    """models/test_restore.py: training resumed from a checkpoint continues where it stopped."""
    first = StepEndRegressor()
    run = _fit(first, 4, devices=2, strategy="dp", max_epochs=1)
    run.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = StepEndRegressor()
    resumed_run = trainer(devices=2, strategy="dp", max_epochs=2)
    resumed_run.fit(resumed, loader(regression_data(), 4), ckpt_path=str(tmp_path / "epoch1.ckpt"))
    straight = StepEndRegressor()
    straight_run = _fit(straight, 4, devices=2, strategy="dp", max_epochs=2)
    assert (resumed_run.current_epoch, resumed_run.global_step) == (straight_run.current_epoch, 10)
    assert_same_parameters(parameters(resumed), parameters(straight))


def test_lightning_parallel_module_unsqueeze_scalar_and_python_scalar_conversion() -> None:
    """overrides/test_data_parallel.py: 0-dim tensors and Python numbers reach step_end as one value per replica.

    torch.nn.DataParallel warns when it gathers 0-dim tensors; the gather here does not.
    """
    gathered: list[dict[str, Any]] = []

    class Scalars(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            assert output["loss"].dim() == 0
            return {**output, "python scalar": 12.3, "count": 2, "flag": True}

        def training_step_end(self, outputs: dict[str, Any]) -> torch.Tensor:
            gathered.append(outputs)
            return outputs["loss"].mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(devices=2, strategy="mgpu_dp", fast_dev_run=True).fit(Scalars())
    assert not [warning for warning in caught if "scalar" in str(warning.message)]
    outputs = gathered[0]
    assert outputs["loss"].shape == torch.Size([2])
    assert torch.equal(outputs["python scalar"], torch.tensor([12.3, 12.3]))
    assert torch.equal(outputs["count"], torch.tensor([2, 2]))
    assert torch.equal(outputs["flag"], torch.tensor([True, True]))


class _Nested(Dataset):
    """1.x's data: one row per replica, ``[[0.0], [1.0]]``, so each replica can check that it got its own row."""

    def __init__(self, nest: Callable[[torch.Tensor], Any]) -> None:
        self.nest = nest

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return self.nest(torch.tensor([float(index)]))


@pytest.mark.parametrize(
    ("nest", "unnest"),
    [
        (lambda x: x, lambda x: x),
        (lambda x: {"data": x}, lambda x: x["data"]),
        (lambda x: [x, Fields((x, x))], lambda x: x[1][0]),
    ],
    ids=["tensor", "dict", "list_tuple"],
)
def test_lightning_parallel_module_device_access(
    nest: Callable[[torch.Tensor], Any], unnest: Callable[[Any], torch.Tensor]
) -> None:
    """overrides/test_data_parallel.py: ``self.device`` in a replica is its parameters' and its rows' device.

    As in 1.x, the batch has 2 rows, one per replica. 1.x's ``[x, (x, x)]`` then holds a pair of 2 alike tensors of
    2 rows, which reads both as fields and as one item per sample, and no earlier batch tells: the dataset marks it
    ``Fields``, and every tensor is split along dim 0, as torch splits it.
    """
    seen: list[tuple[int, list[float]]] = []

    class DeviceAccess(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(1, 3)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = unnest(batch)
            assert x.shape == torch.Size([1, 1])
            assert self.replica_index == x.item()
            assert self.device == self.layer.weight.device == x.device
            seen.append((self.replica_index, x.flatten().tolist()))
            return self.layer(x).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = DeviceAccess()
    trainer(devices=2, strategy="mgpu_dp", max_steps=1).fit(model, DataLoader(_Nested(nest), batch_size=2))
    assert sorted(seen) == [(0, [0.0]), (1, [1.0])], "replica i gets the i-th row"
    assert model.device == torch.device("cpu")


def test_submodules_multi_gpu_dp() -> None:
    """utilities/test_dtype_device_mixin.py: nested modules that track their device agree with the module's."""
    seen: list[tuple[torch.device, torch.device, torch.device]] = []

    class Inner(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = L.LightningModule()

    class Top(_Boring):
        def __init__(self) -> None:
            super().__init__()
            self.module = Inner()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            seen.append((self.device, self.module.device, self.module.inner.device))
            return super().training_step(batch, batch_idx)

    class DeviceAssert(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, model: L.LightningModule, *args: Any) -> None:
            assert isinstance(model, Top)
            assert model.device == model.module.device == model.module.inner.device == trainer.strategy.root_device

    trainer(devices=2, strategy="dp", max_steps=1, callbacks=[DeviceAssert()]).fit(Top())
    assert len(seen) == 2
    assert all(device == module == inner for device, module, inner in seen)


def test_epoch_results_cache_dp() -> None:
    """trainer/logging_/test_logger_connector.py: epoch metrics logged in replicas end on the root device."""

    class Cached(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            self.log("train_loss_epoch", output["loss"], on_step=False, on_epoch=True)
            return output

        def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return outputs["loss"].mean()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            self.log("val_loss_epoch", torch.rand(1, device=self.device), on_step=False, on_epoch=True)

        def test_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            self.log("test_loss_epoch", torch.rand(1, device=self.device), on_step=False, on_epoch=True)

    settings = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "max_epochs": 1}
    single = trainer(**settings)
    single.fit(Cached())
    model = Cached()
    run = trainer(devices=2, strategy="dp", **settings)
    run.fit(model)
    root = run.strategy.root_device
    assert run.callback_metrics["train_loss_epoch"].device == root
    assert run.callback_metrics["val_loss_epoch"].device == root
    torch.testing.assert_close(
        run.callback_metrics["train_loss_epoch"], single.callback_metrics["train_loss_epoch"], atol=1e-6, rtol=0
    )
    run.test(model, verbose=False)
    assert run.callback_metrics["test_loss_epoch"].device == root


@pytest.mark.parametrize(("batches", "log_interval", "max_epochs"), [(1, 1, 1), (8, 4, 2)])
def test__training_step__step_end__epoch_end__log(
    tmp_path: Path, batches: int, log_interval: int, max_epochs: int
) -> None:
    """trainer/logging_/test_train_loop_logging.py: the step (in replicas), step_end and epoch end all log."""

    class Logs(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("a", loss, on_step=True, on_epoch=True)
            return loss

        def training_step_end(self, losses: torch.Tensor) -> torch.Tensor:
            loss = losses.mean()
            self.log("b", loss, on_step=True, on_epoch=True, prog_bar=True, logger=True)
            self.last_loss = loss.detach()
            return loss

        def on_train_epoch_end(self) -> None:
            self.log("c", self.last_loss, on_epoch=True, prog_bar=True, logger=True)
            self.log("d/e/f", 2.0)

    run = trainer(
        devices=2,
        strategy="mgpu_dp",
        limit_train_batches=batches,
        limit_val_batches=0,
        max_epochs=max_epochs,
        log_every_n_steps=log_interval,
        logger=CSVLogger(tmp_path),
    )
    run.fit(Logs())
    logged = set(run.logged_metrics)
    assert logged == {"a_step", "a_epoch", "b_step", "b_epoch", "c", "d/e/f"}
    assert set(run.progress_bar_metrics) == {"c", "b_epoch", "b_step"}
    assert set(run.callback_metrics) == logged | {"a", "b"}
    assert all(isinstance(value, torch.Tensor) for value in run.callback_metrics.values())
    assert all(isinstance(value, float) for value in run.progress_bar_metrics.values())


@pytest.mark.parametrize(
    ("batches", "reduce_fx", "expected"),
    [(3, min, 0), (3, torch.max, 2), (11, max, 10), (5, "avg", 2), (5, "SUM", 10)],
)
def test__training_step__log_max_reduce_fx(batches: int, reduce_fx: Any, expected: float) -> None:
    """trainer/logging_/test_train_loop_logging.py: every ``reduce_fx`` Lightning takes, logged inside replicas.

    Both replicas log the same ``batch_idx``: min, max and mean of equal values are that value, while ``sum`` adds
    the replicas' values as it adds the steps' (as ``sync_dist=True`` adds the processes' under DDP), so it counts
    each step twice here.
    """

    class Logs(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            self.log(
                "foo", torch.tensor(batch_idx, dtype=torch.long), on_step=False, on_epoch=True, reduce_fx=reduce_fx
            )
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            self.log("bar", torch.tensor(batch_idx).float(), on_step=False, on_epoch=True, reduce_fx=reduce_fx)
            return super().validation_step(batch, batch_idx)

    run = trainer(devices=2, strategy="mgpu_dp", limit_train_batches=batches, limit_val_batches=batches, max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*needs to be floating to be reduced.*")
        run.fit(Logs())
    replicas = 2 if reduce_fx == "SUM" else 1
    assert run.callback_metrics["foo"].item() == pytest.approx(expected * replicas)
    assert run.callback_metrics["bar"].item() == pytest.approx(expected * replicas)


def test__validation_step__log(tmp_path: Path) -> None:
    """trainer/logging_/test_eval_loop_logging.py: ``validation_step_end = None`` switches the hook off."""
    called: list[str] = []

    class Logs(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            self.log("a", output["loss"], on_step=True, on_epoch=True)
            self.log("a2", 2.0)
            return output

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            output = super().validation_step(batch, batch_idx)
            self.log("b", output["x"], on_step=True, on_epoch=True)
            return output

        def validation_step_end(self, outputs: Any) -> Any:
            called.append("validation_step_end")
            return outputs

    model = Logs()
    model.validation_step_end = None
    run = trainer(
        devices=2,
        strategy="mgpu_dp",
        limit_train_batches=2,
        limit_val_batches=2,
        max_epochs=2,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
    )
    run.fit(model)
    assert not called
    assert set(run.logged_metrics) == {"a2", "a_step", "a_epoch", "b_step", "b_epoch"}
    assert set(run.callback_metrics) == {"a", "a2", "b", "a_epoch", "b_epoch", "a_step"}


def test_default_level_for_hooks_that_support_logging() -> None:
    """trainer/logging_/test_loop_logging.py: ``self.log`` in a step_end defaults to its step's level.

    ``training_step_end`` logs per step (the last step's value stays), ``validation_step_end`` per epoch (the
    mean over the batches).
    """

    class Logs(StepEndRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.batch_idx = -1
            self.val_batches = 0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.batch_idx = batch_idx

        def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            self.log("train_level", float(self.batch_idx))
            return super().training_step_end(outputs)

        def validation_step_end(self, errors: torch.Tensor) -> None:
            self.log("val_level", float(self.val_batches))
            self.val_batches += 1

    model = Logs()
    run = trainer(devices=2, strategy="mgpu_dp", max_epochs=1)
    run.fit(model, loader(regression_data(), 4), loader(regression_data(rows=9, seed=3), 3))
    assert run.callback_metrics["train_level"].item() == 4.0, "the last of batches 0..4"
    assert run.callback_metrics["val_level"].item() == 1.0, "the mean of batches 0..2"


def test_hook_order_with_step_end_matches_one_device() -> None:
    """models/test_hooks.py: each ``*_step_end`` runs after the step and before anything else sees its output."""

    def run(devices: int, strategy: str, automatic: bool) -> tuple[list[str], list[Any]]:
        calls: list[str] = []
        batch_ends: list[Any] = []

        class Hooked(StepEndRegressor):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = automatic

            def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
                calls.append("on_train_batch_start")

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                calls.append("training_step")
                return super().training_step(batch, batch_idx)

            def training_step_end(self, outputs: dict[str, torch.Tensor]) -> Any:
                calls.append("training_step_end")
                loss = super().training_step_end(outputs)
                if not automatic:
                    optimizer = self.optimizers()
                    optimizer.zero_grad()
                    self.manual_backward(loss)
                    optimizer.step()
                return {"loss": loss, "marker": "from step_end"}

            def on_before_zero_grad(self, optimizer: Any) -> None:
                calls.append("on_before_zero_grad")

            def on_before_backward(self, loss: torch.Tensor) -> None:
                calls.append("on_before_backward")

            def on_after_backward(self) -> None:
                calls.append("on_after_backward")

            def on_before_optimizer_step(self, optimizer: Any) -> None:
                calls.append("on_before_optimizer_step")

            def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
                calls.append("on_train_batch_end")
                batch_ends.append(outputs["marker"])

            def validation_step(self, batch: Any, batch_idx: int) -> Any:
                calls.append("validation_step")
                return super().validation_step(batch, batch_idx)

            def validation_step_end(self, errors: torch.Tensor) -> Any:
                calls.append("validation_step_end")
                return {"val": errors.mean(), "marker": "from validation_step_end"}

            def on_validation_batch_end(self, outputs: Any, *args: Any) -> None:
                calls.append("on_validation_batch_end")
                batch_ends.append(outputs["marker"])

            def predict_step(self, batch: Any, batch_idx: int) -> Any:
                calls.append("predict_step")
                return super().predict_step(batch, batch_idx)

            def predict_step_end(self, predictions: torch.Tensor) -> Any:
                calls.append("predict_step_end")
                return {"rows": predictions.shape[0], "marker": "from predict_step_end"}

            def on_predict_batch_end(self, outputs: Any, *args: Any) -> None:
                calls.append("on_predict_batch_end")
                batch_ends.append(outputs["marker"])

        model = Hooked()
        data = loader(regression_data(rows=4), 4)
        fit = trainer(devices=devices, strategy=strategy, max_steps=1, limit_val_batches=1)
        fit.fit(model, data, data)
        trainer(devices=devices, strategy=strategy).predict(model, data)
        return calls, batch_ends

    train_hooks = ["on_train_batch_start", "training_step", "training_step", "training_step_end"]
    after = ["on_before_backward", "on_after_backward", "on_before_optimizer_step"]
    for automatic in (True, False):
        one_device_calls, one_device_ends = run(1, "mgpu_dp", automatic)
        split_calls, split_ends = run(2, "mgpu_dp", automatic)
        steps = {"training_step", "validation_step", "predict_step"}
        doubled = [name for call in one_device_calls for name in [call] * (2 if call in steps else 1)]
        assert split_calls == doubled, "each replica runs the step; everything else runs once, in the same order"
        assert split_ends == one_device_ends == ["from step_end", "from validation_step_end", "from predict_step_end"]
        zero_grad = ["on_before_zero_grad"] if automatic else []
        assert split_calls[: len(train_hooks) + len(zero_grad) + len(after) + 1] == [
            *train_hooks,
            *zero_grad,
            *after,
            "on_train_batch_end",
        ]
        assert split_calls[-4:] == ["predict_step", "predict_step", "predict_step_end", "on_predict_batch_end"]


class _Deterministic(L.LightningModule):
    """1.x's deterministic model: a fixed linear map whose summed output is 57 per row (171 for 3 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 2, bias=False)
        self.l1.weight = nn.Parameter(torch.tensor([[4.0, 3.0, 5.0], [10.0, 11.0, 13.0]]))

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        output = self.l1(batch)
        assert torch.all(output[:, 0] == 15.0)
        assert torch.all(output[:, 1] == 42.0)
        return output.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.tensor([[0.5, 1.0, 2.0]]).repeat(12, 1), batch_size=3)


def _count_graphs(output: Any) -> int:
    values = output.values() if isinstance(output, dict) else [output]
    return sum(isinstance(value, torch.Tensor) and value.grad_fn is not None for value in values)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("returns", ["scalar", "dict"])
def test__training_step__tr_step_end__flow(devices: int, returns: str) -> None:
    """loops/test_training_loop_flow_{scalar,dict}.py: step, step_end and what the loop receives.

    With one device ``training_step_end`` receives the step's own output, strings included; split over two
    replicas it receives their outputs gathered (strings cannot be), and summing the replicas' sums gives 171.
    """
    losses: list[float] = []
    batch_ends: list[Any] = []

    class Flow(_Deterministic):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            loss = self.step(batch)
            out = loss if returns == "scalar" else {"loss": loss, "random_things": [1, torch.tensor(2)]}
            if devices == 1:
                self.out = out
                if returns == "dict":
                    out["random_things"].append("a")
            return out

        def training_step_end(self, outputs: Any) -> Any:
            if devices == 1:
                assert outputs is self.out
            assert _count_graphs(outputs) == 1
            self.step_end_calls = getattr(self, "step_end_calls", 0) + 1
            if devices == 1:
                return outputs
            if returns == "scalar":
                return outputs.sum()
            assert torch.equal(outputs["random_things"][0], torch.tensor([1, 1]))
            return {**outputs, "loss": outputs["loss"].sum()}

        def on_before_backward(self, loss: torch.Tensor) -> None:
            losses.append(loss.item())

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            batch_ends.append(outputs)

    model = Flow()
    run = trainer(devices=devices, strategy="mgpu_dp", limit_train_batches=2, limit_val_batches=0, max_epochs=2)
    run.fit(model)
    assert model.step_end_calls == 4
    assert losses == [171.0] * 4
    assert all(_count_graphs(outputs) == 0 for outputs in batch_ends), "the loop detaches the loss"
    if returns == "dict" and devices == 1:
        assert batch_ends[0]["random_things"][2] == "a"


@pytest.mark.parametrize("step_end", [True, False], ids=["step_end", "no-step_end"])
def test__eval_step__eval_step_end__flow(step_end: bool) -> None:
    """loops/test_evaluation_loop_flow.py: any output reaches step_end and the batch-end hook on one device.

    Split over replicas, a string cannot be gathered; the error names where it is.
    """
    received: list[Any] = []

    class Flow(_Deterministic):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.step(batch)

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            out = ["1", 2, torch.tensor(2)] if batch_idx == 0 else {"something": "random"}
            if self.num_replicas == 1:
                self.last_out = out
            return out

        def val_dataloader(self) -> DataLoader:
            return self.train_dataloader()

        def validation_step_end(self, outputs: Any) -> Any:
            assert outputs is self.last_out
            received.append("step_end")
            return outputs

        def on_validation_batch_end(self, outputs: Any, *args: Any) -> None:
            received.append(outputs)

    model = Flow()
    if not step_end:
        model.validation_step_end = None
    trainer(devices=1, strategy="mgpu_dp", limit_train_batches=2, limit_val_batches=2, max_epochs=1).fit(model)
    marks = ["step_end"] if step_end else []
    assert received == [*marks, ["1", 2, torch.tensor(2)], *marks, {"something": "random"}]

    with pytest.raises(GatherError, match=r"\[0\] in replica 0 is a str"):
        trainer(devices=2, strategy="mgpu_dp", limit_train_batches=1, limit_val_batches=1, max_epochs=1).fit(Flow())


def test_warning_valid_train_step_end() -> None:
    """loops/test_training_loop.py: a step that returns no loss is fine when training_step_end makes one."""

    class OutputsOnly(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            return {"output": self(batch)}

        def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            output = outputs["output"]
            return nn.functional.mse_loss(output, torch.ones_like(output))

    single, parallel = _Boring(), OutputsOnly()
    trainer(fast_dev_run=3).fit(single)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(devices=2, strategy="mgpu_dp", fast_dev_run=3).fit(parallel)
    assert not [warning for warning in caught if "training_step" in str(warning.message)]
    assert_same_parameters(parameters(single), parameters(parallel))


def test_lr_finder_ends_before_num_training(tmp_path: Path) -> None:
    """tuner/test_lr_finder.py: the learning-rate finder runs its steps through training_step_end."""

    class Tuned(_Boring):
        def __init__(self, learning_rate: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()

        def training_step_end(self, outputs: dict[str, torch.Tensor]) -> Any:
            assert self.global_step < 3
            return self.trainer.strategy.reduce(outputs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    finder = Tuner(trainer(tmp_path, devices=2, strategy="mgpu_dp")).lr_find(Tuned(), num_training=3)
    assert finder is not None
    assert 0 < len(finder.results["lr"]) <= 3


class _Writer(BasePredictionWriter):
    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)  # type: ignore[arg-type]
        self.batches = 0
        self.epochs = 0

    def write_on_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def write_on_epoch_end(self, *args: Any) -> None:
        self.epochs += 1


class _PredictData(L.LightningDataModule):
    def predict_dataloader(self) -> list[DataLoader]:
        return [_random_rows(2, batch_size=1, seed=seed) for seed in (0, 1)]


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("datamodule", [False, True])
def test_trainer_predict_standalone(devices: int, datamodule: bool) -> None:
    """trainer/test_trainer.py: predict over two dataloaders, with prediction writers, under ``dp``."""
    by_batch, by_epoch = _Writer("batch"), _Writer("epoch")
    run = trainer(devices=devices, strategy="dp", callbacks=[by_batch, by_epoch])
    data = _PredictData()
    if datamodule:
        results = run.predict(_Boring(), datamodule=data)
    else:
        results = run.predict(_Boring(), dataloaders=data.predict_dataloader())
    assert (by_batch.batches, by_batch.epochs, by_epoch.batches, by_epoch.epochs) == (4, 0, 0, 1)
    assert len(results) == 2
    assert [len(predictions) for predictions in results] == [2, 2]
    assert results[0][0].shape == torch.Size([1, 2])


@pytest.mark.parametrize("strategy", ["dp", "DP", "mgpu_dp", MGPUDPStrategy()], ids=["dp", "DP", "mgpu_dp", "instance"])
def test_strategy_choice_str_and_instance(strategy: Any) -> None:
    """trainer/test_trainer.py, trainer/connectors/test_accelerator_connector.py: what ``dp`` selects.

    1.x fell back to DDP for ``dp`` on the CPU; here the CPU gets virtual replicas. As in 1.x, no launcher starts
    processes, so it runs in notebooks.
    """
    run = trainer(devices=2, strategy=strategy)
    assert isinstance(run.strategy, MGPUDPStrategy)
    assert run.strategy.strategy_name == "mgpu_dp"
    assert (run.num_devices, run.world_size) == (2, 1)
    assert run.strategy.launcher is None


def test_num_stepping_batches_dp() -> None:
    """trainer/properties/test_estimated_stepping_batches.py: one process steps once per batch, on any devices."""
    counted: list[int] = []

    class Count(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            counted.append(trainer.estimated_stepping_batches)
            trainer.should_stop = True

    trainer(devices=7, strategy="dp", callbacks=[Count()]).fit(_Boring(), _random_rows(64, batch_size=1))
    assert counted == [64]


def test_amp_dp() -> None:
    """models/test_amp.py: fit, test and predict in mixed precision (bf16 on the CPU) under ``dp``."""
    dtypes: set[torch.dtype] = set()

    class Mixed(_Boring):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
            dtypes.add(self(batch).dtype)
            return {"loss": self.loss(batch).float()}

    model = Mixed()
    settings = {"devices": 2, "strategy": "dp", "precision": "bf16-mixed"}
    run = trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=2, **settings)
    run.fit(model)
    trainer(limit_test_batches=2, **settings).test(model, verbose=False)
    predictions = trainer(**settings).predict(model, _random_rows(4, batch_size=2))
    assert dtypes == {torch.bfloat16}
    assert [prediction.shape for prediction in predictions] == [torch.Size([2, 2])] * 2


def test_batch_transfer_hooks_run_once_on_the_whole_batch() -> None:
    """trainer/test_config_validator.py: 1.x refused these hooks under ``dp``; here they run before the split."""
    transfers: list[tuple[int, torch.device]] = []

    class Shifted(Regressor):
        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            transfers.append((batch[0].shape[0], device))
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            x, y = batch
            return x + 1, y

    single, parallel = Shifted(), Shifted()
    _fit(single, 4, max_steps=3)
    transfers.clear()
    _fit(parallel, 4, max_steps=3, devices=2, strategy="dp")
    assert transfers == [(4, torch.device("cpu"))] * 3
    assert_same_parameters(parameters(single), parameters(parallel))


def test_trainer_compiled_model() -> None:
    """trainer/test_trainer.py: a compiled LightningModule is refused under ``dp``, by Lightning, as in 1.x."""
    compiled = torch.compile(_Boring(), backend="eager")
    with pytest.raises(RuntimeError, match="Using a compiled model is incompatible with the current strategy"):
        trainer(devices=2, strategy="dp", fast_dev_run=True).fit(compiled)
