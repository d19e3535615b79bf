"""``self.log`` and ``self.log_dict`` inside mgpu_dp's replicas refuse and record exactly what they do on one device.

Each case runs one module on one device (Lightning's default strategy) and under mgpu_dp with 2 and 3 replicas, in
both Lightning namespaces: the same exception type and message, or the same logged values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from models import PLRegressor, Regressor, loader, regression_data, trainer
from torch import nn

from lightning_mgpu import ReplicaStateError
from lightning_mgpu.namespaces import LIGHTNING
from lightning_mgpu.step.replica_log import ReplicaLog

Body = Callable[[Any, int], None]
"""What a step logs: called with the module (a replica under mgpu_dp) and the batch index."""

NAMESPACES = {"lightning.pytorch": (Regressor, lp.Trainer), "pytorch_lightning": (PLRegressor, pl.Trainer)}


def _module(base: type, body: Body, with_metric: bool) -> Any:
    class Logs(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            if with_metric:
                self.total = torchmetrics.SumMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            body(self, batch_idx)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            body(self, batch_idx)
            return super().validation_step(batch, batch_idx)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            body(self, batch_idx)
            return super().predict_step(batch, batch_idx)

    return Logs()


def _run(body: Body, namespace: str, devices: int, stage: str, steps: int = 1, with_metric: bool = False) -> Any:
    """The metrics the run logged, ``(logged_metrics, callback_metrics)`` as floats, or the exception it raised."""
    base, trainer_class = NAMESPACES[namespace]
    strategy = {"strategy": "mgpu_dp"} if devices > 1 else {}
    run = trainer(trainer_class=trainer_class, devices=devices, max_steps=steps, limit_val_batches=steps, **strategy)
    module = _module(base, body, with_metric)
    data = loader(regression_data(rows=6 * steps), 6)
    try:
        if stage == "fit":
            run.fit(module, data)
        elif stage == "validate":
            run.validate(module, data, verbose=False)
        else:
            run.predict(module, data)
    except Exception as error:  # noqa: BLE001 - the outcome compared
        return error
    return (
        {name: float(value) for name, value in run.logged_metrics.items()},
        {name: float(value) for name, value in run.callback_metrics.items()},
    )


def _assert_as_on_one_device(body: Body, namespace: str, devices: int, stage: str = "fit", **options: Any) -> Any:
    one = _run(body, namespace, 1, stage, **options)
    split = _run(body, namespace, devices, stage, **options)
    if isinstance(one, Exception):
        assert isinstance(split, Exception), f"one device raised {one!r}; {devices} replicas logged {split}"
        assert (type(split), str(split)) == (type(one), str(one))  # the message, without the replica's note
        return one
    assert not isinstance(split, Exception), f"one device logged {one}; {devices} replicas raised {split!r}"
    for logged, expected in zip(split, one, strict=True):
        assert logged.keys() == expected.keys()
        for name, value in expected.items():
            assert logged[name] == pytest.approx(value, abs=1e-6), name
    return one


both = pytest.mark.parametrize("namespace", list(NAMESPACES))
replicas = pytest.mark.parametrize("devices", [2, 3])


def _twice_on_step(module: Any, batch_idx: int) -> None:
    module.log("k", 1.0)
    module.log("k", 3.0)


@both
@replicas
def test_a_name_logged_twice_in_a_step_keeps_the_last_value_on_step(namespace: str, devices: int) -> None:
    logged, _ = _assert_as_on_one_device(_twice_on_step, namespace, devices)
    assert logged["k"] == 3.0
    split, _ = _run(_twice_on_step, namespace, devices, "fit")
    assert split["k"] == 3.0, "the second call's value, not the mean of both"


def _twice_on_step_and_epoch(module: Any, batch_idx: int) -> None:
    module.log("k", 1.0, on_step=True, on_epoch=True)
    module.log("k", 3.0, on_step=True, on_epoch=True)
    module.log("x", float(getattr(module, "replica_index", 0)), on_step=True)
    module.log("x", 5.0, on_step=True)


def _twice_in_validation(module: Any, batch_idx: int) -> None:
    module.log_dict({"v": 1.0 + batch_idx, "w": 2.0})
    module.log("v", 4.0 + batch_idx, reduce_fx=torch.mean)


@both
@replicas
def test_a_name_logged_twice_in_a_step_counts_both_values_in_the_epoch_aggregate(namespace: str, devices: int) -> None:
    logged, _ = _assert_as_on_one_device(_twice_on_step_and_epoch, namespace, devices)
    assert (logged["k_step"], logged["k_epoch"], logged["x"]) == (3.0, 2.0, 5.0)
    _, callback = _assert_as_on_one_device(_twice_in_validation, namespace, devices, "validate", steps=2)
    assert callback["v"] == pytest.approx((1 + 4 + 2 + 5) / 4)


def _positional_options(module: Any, batch_idx: int) -> None:
    module.log("k", torch.tensor(2.0), True, False)  # prog_bar, logger


@both
@replicas
def test_options_passed_by_position_are_taken_as_on_one_device(namespace: str, devices: int) -> None:
    _assert_as_on_one_device(_positional_options, namespace, devices)


REFUSED: dict[str, Body] = {
    "None": lambda module, batch_idx: module.log("x", None),
    "None in log_dict": lambda module, batch_idx: module.log_dict({"a": 1.0, "b": None}),
    "a dict": lambda module, batch_idx: module.log("x", {"a": 1.0}),
    "a nested dict": lambda module, batch_idx: module.log("x", {"a": {"b": 1.0}}),
    "a string": lambda module, batch_idx: module.log("x", "text"),
    "a list": lambda module, batch_idx: module.log("x", [1.0, 2.0]),
    "a tensor of two elements": lambda module, batch_idx: module.log("x", torch.ones(2)),
    "a metric made in the step": lambda module, batch_idx: module.log("m", torchmetrics.SumMetric()),
    "twice with another prog_bar": lambda module, batch_idx: (
        module.log("k", 1.0),
        module.log("k", 3.0, prog_bar=True),
    ),
    "twice with another on_epoch": lambda module, batch_idx: (
        module.log("k", 1.0),
        module.log("k", 3.0, on_epoch=True),
    ),
    "twice with sum and torch.sum": lambda module, batch_idx: (
        module.log("k", 1.0, reduce_fx=sum),
        module.log("k", 3.0, reduce_fx=torch.sum),
    ),
    "twice through log_dict with another reduce_fx": lambda module, batch_idx: (
        module.log_dict({"k": 1.0}, reduce_fx="max"),
        module.log_dict({"k": 3.0}, reduce_fx="min"),
    ),
    "reduce_fx='median'": lambda module, batch_idx: module.log("k", 1.0, reduce_fx="median"),
    "reduce_fx=torch.median": lambda module, batch_idx: module.log("k", 1.0, reduce_fx=torch.median),
}


@both
@replicas
@pytest.mark.parametrize("case", list(REFUSED))
def test_what_one_device_refuses_replicas_refuse_with_the_same_error(namespace: str, devices: int, case: str) -> None:
    _assert_as_on_one_device(REFUSED[case], namespace, devices)


OPTIONS_REFUSED: dict[str, Body] = {
    "another prog_bar in the next step": lambda module, batch_idx: module.log("k", 1.0, prog_bar=batch_idx > 0),
    "on_step=False in training_step": lambda module, batch_idx: module.log("k", 1.0, on_step=False),
    "a dataloader_idx in the name": lambda module, batch_idx: module.log("k/dataloader_idx_0", 1.0),
    "an unknown option": lambda module, batch_idx: module.log("k", 1.0, foo=True),
}


@both
@replicas
@pytest.mark.parametrize("case", list(OPTIONS_REFUSED))
def test_options_lightning_refuses_are_refused_with_the_same_error(namespace: str, devices: int, case: str) -> None:
    _assert_as_on_one_device(OPTIONS_REFUSED[case], namespace, devices, steps=2)


@both
@replicas
def test_a_metric_made_in_the_step_is_refused_naming_the_modules_metrics(namespace: str, devices: int) -> None:
    refused = _assert_as_on_one_device(REFUSED["a metric made in the step"], namespace, devices, with_metric=True)
    assert "where `name` is one of ['total']" in str(refused)


@both
@replicas
def test_logging_in_predict_step_is_refused_as_on_one_device(namespace: str, devices: int) -> None:
    _assert_as_on_one_device(lambda module, batch_idx: module.log("k", 1.0), namespace, devices, "predict")


@replicas
def test_a_metric_made_in_the_step_and_logged_by_its_metric_attribute_is_refused_with_the_fix(devices: int) -> None:
    def body(module: Any, batch_idx: int) -> None:
        metric = torchmetrics.SumMetric()
        metric.update(torch.tensor(1.0))
        module.log("made", metric, metric_attribute="made")

    refused = _run(body, "lightning.pytorch", devices, "fit")
    assert isinstance(refused, ReplicaStateError)
    assert "each replica's holds only the rows that replica received" in str(refused)
    assert refused.path == "self.log('made')"


class _Checked(lp.LightningModule):
    """Calls a ``ReplicaLog`` given itself, as a replica's, from its training step; keeps what each call did."""

    def __init__(self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.calls = calls
        self.outcomes: list[BaseException | None] = []
        self.records: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        log = ReplicaLog(0, 6, LIGHTNING, self)
        for args, kwargs in self.calls:
            try:
                log(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the outcome compared
                self.outcomes.append(error)
            else:
                self.outcomes.append(None)
        self.records = log.records
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_replicas_log_raises_lightnings_error_at_the_call_and_records_only_what_passes() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("x", None), {}),
        (("k", 1.0), {}),
        (("k", 3.0), {"prog_bar": True}),
        (("j", 2.0, True), {}),
    ]
    module = _Checked(calls)
    fitted = trainer(max_steps=1)
    fitted.fit(module, loader(regression_data(rows=6), 6))
    none, first, other_prog_bar, positional = module.outcomes
    assert isinstance(none, ValueError)
    assert str(none) == "`self.log(x, None)` was called, but `NoneType` values cannot be logged"
    assert first is None
    assert isinstance(other_prog_bar, LIGHTNING.MisconfigurationException)
    assert str(other_prog_bar) == (
        "You called `self.log(k, ...)` twice in `training_step` with different arguments. This is not allowed"
    )
    assert positional is None
    assert module.records == [("k", 1.0, {}), ("j", 2.0, {"prog_bar": True})]
    assert "k" not in fitted.logged_metrics, "the checks record nothing into the Trainer's results"
