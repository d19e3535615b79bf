"""What a step changes besides parameters and buffers, inside ``mgpu_dp``'s replicas: torchmetrics and plain state.

Replicas are threads. Each has its own copy of the module's metrics and of the plain lists, dicts and sets of the
model's own code; after the step they go back into the module in batch order, through torchmetrics' ``merge_state``
for metrics, or the run stops with ``ReplicaStateError``. Every comparison runs the mgpu_dp side twice: a result must
not depend on which thread ran first.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from models import assert_same_parameters, parameters, trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import classification, retrieval, wrappers

from lightning_mgpu import MGPUDataParallel, MGPUMixin, ReplicaStateError, check_model
from lightning_mgpu.engine import replicate

CPU2 = [torch.device("cpu")] * 2
ROWS, BATCH = 23, 5  # chunks of 3 + 2 and 2 + 2 + 1 rows, and a last batch of 3


def _data(seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (ROWS,), generator=generator)
    query = torch.arange(ROWS) // 3  # retrieval: three documents per query, queries cut by the chunks
    relevant = torch.randint(0, 2, (ROWS,), generator=generator)
    return DataLoader(TensorDataset(x, y, query, relevant), batch_size=BATCH)


def _metrics() -> dict[str, nn.Module]:
    """One of each kind of state: sums, means, lists (in order), maxima, compute groups, wrappers, retrieval.

    ``composed`` is a ``CompositionalMetric``, whose metrics hold the states it computes from.
    """
    return {
        "accuracy": classification.MulticlassAccuracy(3, average="macro"),
        "auroc": classification.MulticlassAUROC(3),
        "cat": torchmetrics.CatMetric(),
        "mean": torchmetrics.MeanMetric(),
        "sum": torchmetrics.SumMetric(),
        "scores": torchmetrics.MetricCollection(
            {
                "precision": classification.MulticlassPrecision(3),
                "recall": classification.MulticlassRecall(3),
                "f1": classification.MulticlassF1Score(3),
            }
        ),
        "classwise": wrappers.ClasswiseWrapper(classification.MulticlassAccuracy(3, average=None)),
        "mrr": retrieval.RetrievalMRR(),
        "psnr": torchmetrics.image.PeakSignalNoiseRatio(data_range=1.0),
        "composed": torchmetrics.SumMetric() + torchmetrics.MeanMetric(),  # a CompositionalMetric
        "multitask": wrappers.MultitaskWrapper(
            {"task_auroc": classification.MulticlassAUROC(3), "task_error": torchmetrics.MeanSquaredError()}
        ),
    }


def _arguments(name: str, logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    _, y, query, relevant = batch
    probabilities = logits.softmax(-1)
    return {
        "accuracy": (logits, y),
        "auroc": (probabilities, y),
        "cat": (logits[:, 0],),
        "mean": (F.cross_entropy(logits, y, reduction="none"), (query + 1).to(logits.dtype)),
        "sum": (logits.sum(),),
        "scores": (logits, y),
        "classwise": (logits, y),
        "mrr": (logits[:, 0], relevant, query),
        "psnr": (probabilities[:, 0], relevant.to(logits.dtype)),
        "composed": (logits[:, 0],),
        "multitask": (
            {"task_auroc": probabilities, "task_error": logits[:, 0]},
            {"task_auroc": y, "task_error": logits[:, 1]},
        ),
    }[name]


class MetricsInSteps(L.LightningModule):
    """torchmetrics as its documentation shows: updated, called and logged inside ``training_step``/``validation_step``.

    ``how`` is ``"update"`` (``metric.update(...)``, the metric logged per epoch), ``"call"`` (``value = metric(...)``,
    the value logged per step) or ``"log_metric"`` (the metric called, then the Metric object logged per step and
    per epoch).
    """

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.train_metrics = nn.ModuleDict(_metrics())
        self.val_metrics = nn.ModuleDict(_metrics())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        self._use(self.train_metrics, "train", logits.detach(), batch)
        return F.cross_entropy(logits, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._use(self.val_metrics, "val", self(batch[0]), batch)

    def _use(self, metrics: nn.ModuleDict, stage: str, logits: torch.Tensor, batch: Any) -> None:
        for name, metric in metrics.items():
            arguments = _arguments(name, logits, batch)
            scalar = isinstance(metric, torchmetrics.Metric) and name not in ("cat", "classwise", "multitask")
            if self.how == "update":
                # A composition's update updates nothing: its metrics hold the states.
                parts = (metric.metric_a, metric.metric_b) if name == "composed" else (metric,)
                for part in parts:
                    part.update(*arguments)
                if scalar:
                    self.log(f"{stage}_{name}", metric, on_step=False, on_epoch=True)
                elif name == "multitask":  # its metrics by task, as torchmetrics' docs log them
                    self.log_dict(metric, on_step=False, on_epoch=True)
            elif self.how == "call":
                value = metric(*arguments)
                if isinstance(value, dict):
                    self.log_dict({f"{stage}_{key}": item for key, item in value.items()}, on_step=True)
                elif name != "cat":  # CatMetric's value holds every row
                    self.log(f"{stage}_{name}", value, on_step=True, on_epoch=False)
            else:
                metric(*arguments)
                if scalar:
                    self.log(f"{stage}_{name}", metric, on_step=True, on_epoch=True)
                elif name == "multitask":
                    self.log_dict(metric, on_step=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Recorder(L.Callback):
    """Every value logged at each training step, and at the end of each validation."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append({key: value.clone() for key, value in trainer.callback_metrics.items()})

    def on_validation_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append({key: value.clone() for key, value in trainer.callback_metrics.items()})


def _run(model: L.LightningModule, **settings: Any) -> list[dict[str, torch.Tensor]]:
    recorder = _Recorder()
    run = trainer(max_epochs=2, callbacks=[recorder], **settings)
    run.fit(model, _data(), _data(seed=1))
    return recorder.steps


def _assert_close(left: Any, right: Any, what: str) -> None:
    if isinstance(left, dict):
        assert left.keys() == right.keys(), what
        for key in left:
            _assert_close(left[key], right[key], f"{what}[{key!r}]")
    else:
        torch.testing.assert_close(
            torch.as_tensor(left).double(),
            torch.as_tensor(right).double(),
            atol=1e-6,
            rtol=1e-6,
            equal_nan=True,
            msg=what,
        )


def _states(metric: nn.Module) -> dict[str, Any]:
    """Every state of every metric in ``metric``, list states joined, with each metric's update count."""
    states: dict[str, Any] = {}
    for name, inner in metric.named_modules():
        if isinstance(inner, torchmetrics.Metric):
            for key, value in inner.metric_state.items():
                if isinstance(value, list):
                    value = torch.cat([item.reshape(-1) for item in value]) if value else torch.zeros(0)
                states[f"{name}.{key}"] = value
            states[f"{name}.update_count"] = inner.update_count
    return states


def _assert_same_metrics(one_device: MetricsInSteps, split: MetricsInSteps) -> None:
    for stage in ("train_metrics", "val_metrics"):
        for name, metric in getattr(one_device, stage).items():
            other = getattr(split, stage)[name]
            _assert_close(_states(metric), _states(other), f"{stage}.{name}")
            if _states(metric).get(".update_count", 1):
                _assert_close(metric.compute(), other.compute(), f"{stage}.{name}.compute()")


@pytest.mark.parametrize("how", ["update", "call", "log_metric"])
@pytest.mark.parametrize("devices", [2, 3])
def test_metrics_in_the_steps_end_as_on_one_device(how: str, devices: int) -> None:
    one_device = MetricsInSteps(how)
    expected = _run(one_device)
    for _ in range(2):
        split = MetricsInSteps(how)
        logged = _run(split, devices=devices, strategy="mgpu_dp")
        assert len(logged) == len(expected)
        for index, (values, wanted) in enumerate(zip(logged, expected, strict=True)):
            _assert_close(values, wanted, f"logged values at record {index}")
        _assert_same_metrics(one_device, split)
        assert_same_parameters(parameters(one_device.layer), parameters(split.layer))


class _ChunkValues(MGPUMixin, L.LightningModule):
    """Returns, from each replica, what calling a metric there gave, for the hook to see."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3).double()
        self.accuracy = classification.MulticlassAccuracy(3, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.layer(batch[0])
        return {"loss": F.cross_entropy(logits, batch[1]), "accuracy": self.accuracy(logits, batch[1])}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen = outputs["accuracy"]
        return outputs["loss"].mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_metric_called_in_a_replica_returns_its_chunks_value() -> None:
    model = _ChunkValues()
    trainer(devices=2, strategy="mgpu_dp", max_steps=1).fit(model, _data())
    x, y = next(iter(_data()))[:2]
    logits = model.layer(x)
    chunks = [(logits[:3], y[:3]), (logits[3:], y[3:])]
    expected = torch.stack([(chunk.argmax(-1) == target).double().mean() for chunk, target in chunks])
    torch.testing.assert_close(model.seen.double(), expected)
    torch.testing.assert_close(model.accuracy.compute().double(), (logits.argmax(-1) == y).double().mean())


# --------------------------------------------------------------------------------------------- any metric, any flag


class _Counted(torchmetrics.Metric):
    """A metric of one's own, written without saying whether its update needs the state so far."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, others: torch.Tensor) -> None:
        self.total += values.sum() + others.sum()

    def compute(self) -> torch.Tensor:
        return self.total


class _Declared(_Counted):
    full_state_update = False


class _MergesNothing(_Declared):
    def merge_state(self, incoming_state: Any) -> None:
        raise NotImplementedError("this metric keeps a running state that does not add up")


def _pairs(logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return logits[:, 0], logits[:, 1]


def _words(logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    """Per-row sentences, as text metrics take them: a list of strings, and a list of lists of references."""
    words = ["cat", "dog", "bird"]
    predicted = [f"the {words[int(index)]} sat on the mat" for index in logits.argmax(-1)]
    references = [[f"the {words[int(label)]} sat on the mat"] for label in batch[1]]
    return predicted, references


# Metrics torchmetrics' merge_state refuses: full_state_update=True (or undeclared), dist_sync_on_step=True, a merge
# of their own that raises. Given one value per row, the module's metric takes the whole batch once, as on one device.
_UNMERGEABLE: dict[str, tuple[Callable[[], torchmetrics.Metric], Callable[..., tuple[Any, ...]]]] = {
    "pearson": (torchmetrics.regression.PearsonCorrCoef, _pairs),
    "spearman": (torchmetrics.regression.SpearmanCorrCoef, _pairs),
    "max": (torchmetrics.MaxMetric, lambda logits, batch: (logits[:, 0],)),
    "min": (torchmetrics.MinMetric, lambda logits, batch: (logits[:, 0],)),
    "minmax": (lambda: wrappers.MinMaxMetric(torchmetrics.MeanSquaredError()), _pairs),
    "undeclared": (_Counted, _pairs),
    "dist_sync_on_step": (lambda: _Declared(dist_sync_on_step=True), _pairs),
    "own-merge-refuses": (_MergesNothing, _pairs),
    "bootstrapper": (lambda: wrappers.BootStrapper(torchmetrics.MeanSquaredError(), num_bootstraps=3), _pairs),
    "running": (lambda: wrappers.Running(torchmetrics.MeanSquaredError(), window=2), _pairs),
    "bleu": (torchmetrics.text.BLEUScore, _words),
}


class _UpdatesInStep(L.LightningModule):
    """Updates, or calls and logs, a metric in ``training_step``."""

    def __init__(
        self, metric: torchmetrics.Metric, arguments: Callable[..., tuple[Any, ...]] = _pairs, how: str = "update"
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.metric = metric
        self.arguments = arguments
        self.how = how

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        logits = self.layer(batch[0])
        arguments = self.arguments(logits.detach(), batch)
        if self.how == "update":
            self.metric.update(*arguments)
        else:
            value = self.metric(*arguments)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                self.log("value", value, on_step=True)
        return F.cross_entropy(logits, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Wrappers(L.LightningModule):
    """torchmetrics' wrappers updated, called and logged in the steps, and collections with and without groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.running = wrappers.Running(torchmetrics.MeanSquaredError(), window=3)
        self.minmax = wrappers.MinMaxMetric(torchmetrics.MeanSquaredError())
        self.bootstrap = wrappers.BootStrapper(torchmetrics.MeanSquaredError(), num_bootstraps=4)
        self.tracker = wrappers.MetricTracker(classification.MulticlassAccuracy(3))
        self.classwise = wrappers.ClasswiseWrapper(classification.MulticlassRecall(3, average=None))
        self.grouped = torchmetrics.MetricCollection(
            [classification.MulticlassPrecision(3), classification.MulticlassRecall(3)], prefix="grouped_"
        )
        self.ungrouped = torchmetrics.MetricCollection(
            [classification.MulticlassPrecision(3), classification.MulticlassAUROC(3)],
            prefix="ungrouped_",
            compute_groups=False,
        )
        self.evaluated = torchmetrics.MetricCollection(
            {"accuracy": classification.MulticlassAccuracy(3), "f1": classification.MulticlassF1Score(3)}
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0 or self.tracker.n_steps == 0:  # a resumed epoch starts at a later batch
            self.tracker.increment()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.layer(batch[0])
        scores, y = logits.detach(), batch[1]
        self.running(scores[:, 0], scores[:, 1])
        self.log("running", self.running, on_step=True, on_epoch=True)
        # MinMaxMetric keeps its min and max in plain attributes, which no checkpoint holds: only its value is logged.
        self.log("minmax_raw", self.minmax(scores[:, 0], scores[:, 1])["raw"])
        self.bootstrap.update(scores[:, 0], scores[:, 1])
        self.tracker.update(scores, y)
        self.log_dict(self.classwise(scores, y), on_step=True)
        self.grouped.update(scores, y)
        self.log_dict(self.grouped, on_step=False, on_epoch=True)
        self.log_dict(self.ungrouped(scores.softmax(-1), y), on_step=True, on_epoch=False)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluated.update(self.layer(batch[0]), batch[1])
        self.log_dict(self.evaluated, on_step=False, on_epoch=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        values = self.evaluated(self.layer(batch[0]), batch[1])
        self.log_dict({f"test_{key}": value for key, value in values.items()}, on_step=True, on_epoch=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _straight_run(tmp_path: Path) -> tuple[_Wrappers, list[dict[str, torch.Tensor]]]:
    """Two epochs on one device, then a test: the model, and what was logged at each step and validation."""
    model, recorder = _Wrappers(), _Recorder()
    run = trainer(tmp_path, callbacks=[recorder], max_epochs=2)
    run.fit(model, _data(), _data(seed=1))
    run.test(model, _data(seed=2), verbose=False)
    recorder.steps.append({key: value.clone() for key, value in run.callback_metrics.items()})
    return model, recorder.steps


def _resumed_run(tmp_path: Path, devices: int) -> tuple[_Wrappers, list[dict[str, torch.Tensor]]]:
    """The same under mgpu_dp, stopped after step 3 and resumed from its checkpoint: what the resumed run logged."""
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    settings: dict[str, Any] = {"max_epochs": 2, "devices": devices, "strategy": "mgpu_dp"}
    trainer(tmp_path, enable_checkpointing=True, callbacks=[saving], max_steps=3, **settings).fit(
        _Wrappers(), _data(), _data(seed=1)
    )
    model, recorder = _Wrappers(), _Recorder()
    resumed = trainer(tmp_path, callbacks=[recorder], **settings)
    resumed.fit(model, _data(), _data(seed=1), ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    resumed.test(model, _data(seed=2), verbose=False)
    recorder.steps.append({key: value.clone() for key, value in resumed.callback_metrics.items()})
    return model, recorder.steps


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_wrappers_and_collections_in_every_step_equal_one_device_across_a_mid_epoch_resume(
    tmp_path: Path, devices: int
) -> None:
    one_device, expected = _straight_run(tmp_path / "one")
    expected = expected[3:]  # the resumed run logs from step 4 on
    for attempt in range(2):
        split, logged = _resumed_run(tmp_path / f"run{attempt}", devices)
        assert len(logged) == len(expected)
        for index, (values, wanted) in enumerate(zip(logged, expected, strict=True)):
            _assert_close(values, wanted, f"{devices} replicas: logged values at record {index}")
        for name in ("running", "minmax", "bootstrap", "classwise", "grouped", "ungrouped", "evaluated"):
            _assert_close(_states(getattr(split, name)), _states(getattr(one_device, name)), f"{name} states")
            if name != "minmax":
                _assert_close(getattr(split, name).compute(), getattr(one_device, name).compute(), f"{name}.compute()")
        _assert_close(split.tracker.compute_all(), one_device.tracker.compute_all(), "tracker.compute_all()")


class _UpdatesInStepEnd(_UpdatesInStep):
    """Updates the metric in ``training_step_end``, on the outputs gathered from every replica."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"logits": self.layer(batch[0]), "y": batch[1]}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.metric.update(outputs["logits"][:, 0], outputs["logits"][:, 1])
        return F.cross_entropy(outputs["logits"], outputs["y"])


@pytest.mark.parametrize("how", ["update", "call"])
@pytest.mark.parametrize("name", list(_UNMERGEABLE))
def test_metrics_torchmetrics_cannot_merge_given_rows_in_the_step_end_as_on_one_device(name: str, how: str) -> None:
    make, arguments = _UNMERGEABLE[name]
    reference = _UpdatesInStep(make().double(), arguments=arguments, how=how)
    # A BootStrapper called in a replica resamples that replica's rows from the replica's own generator, so the
    # run's later draws are not one device's: such a run repeats exactly, and is compared with its first run.
    repeats = name == "bootstrapper" and how == "call"
    expected = _run(reference, devices=3, strategy="mgpu_dp") if repeats else _run(reference)
    for devices in (3,) if repeats else (2, 3, 3):
        split = _UpdatesInStep(make().double(), arguments=arguments, how=how)
        logged = _run(split, devices=devices, strategy="mgpu_dp")
        for index, (values, wanted) in enumerate(zip(logged, expected, strict=True)):
            _assert_close(values, wanted, f"{devices} devices: logged values at record {index}")
        _assert_close(_states(split.metric), _states(reference.metric), f"{devices} devices: states")
        _assert_close(split.metric.compute(), reference.metric.compute(), f"{devices} devices: compute()")
        assert_same_parameters(parameters(reference.layer), parameters(split.layer))


def _sums(logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return logits[:, 0].sum(), logits[:, 1].sum()


@pytest.mark.parametrize(
    ("metric", "reason"),
    [
        (torchmetrics.MaxMetric(), "full_state_update=True"),
        (_Counted(), "full_state_update=True"),
        (_Declared(dist_sync_on_step=True), "dist_sync_on_step=True"),
        (_MergesNothing(), "does not add up"),
        (wrappers.Running(torchmetrics.SumMetric(), window=2), "full_state_update=True"),
    ],
    ids=["max", "undeclared", "dist_sync_on_step", "own-merge-refuses", "running"],
)
def test_a_value_of_the_replicas_rows_given_to_a_metric_that_cannot_be_merged_stops_the_first_step(
    metric: torchmetrics.Metric, reason: str
) -> None:
    model = _UpdatesInStep(metric.double(), arguments=_sums)
    before = parameters(model.layer)
    with pytest.raises(ReplicaStateError) as caught:
        trainer(devices=2, strategy="mgpu_dp", max_steps=3).fit(model, _data())
    assert caught.value.path.startswith("self.metric")
    assert caught.value.step == "training_step"
    message = str(caught.value)
    assert "argument 1 of self.metric.update, a 0-dim tensor" in message
    assert reason in message
    assert "one value per row" in message
    assert "*_step_end" in message
    assert_same_parameters(before, parameters(model.layer), atol=0)


class _CalledThenRefused(_UpdatesInStep):
    """Calls a metric the replicas' copies merge, then gives another one a value it cannot take."""

    def __init__(self) -> None:
        super().__init__(classification.MulticlassAccuracy(3))
        self.best = torchmetrics.MaxMetric().double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.layer(batch[0])
        self.metric(logits, batch[1])
        loss = F.cross_entropy(logits, batch[1])
        self.best.update(loss.detach())
        return loss


def test_a_refused_metric_leaves_every_metric_of_the_module_as_it_was() -> None:
    model = _CalledThenRefused()
    with pytest.raises(ReplicaStateError, match="self.best"):
        trainer(devices=2, strategy="mgpu_dp", max_steps=1).fit(model, _data())
    assert model.metric.update_count == 0
    assert model.best.update_count == 0


def test_a_value_of_the_replicas_rows_given_to_a_sum_is_added_as_ddp_ranks_are() -> None:
    one_device = _UpdatesInStep(_Declared(), arguments=_sums)
    _run(one_device)
    split = _UpdatesInStep(_Declared(), arguments=_sums)
    _run(split, devices=3, strategy="mgpu_dp")
    _assert_close(_states(split.metric), _states(one_device.metric), "states")


class _TwoBootstraps(L.LightningModule):
    """Two metrics that draw random numbers, updated in the other order than the module holds them."""

    def __init__(self, change_after: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.first = wrappers.BootStrapper(torchmetrics.MeanSquaredError(), num_bootstraps=3).double()
        self.second = wrappers.BootStrapper(torchmetrics.MeanAbsoluteError(), num_bootstraps=3).double()
        self.change_after = change_after

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.layer(batch[0])
        scores, others = logits.detach().clone(), logits.detach().clone()
        self.second.update(scores[:, 0], scores[:, 1])
        self.first.update(others[:, 1], others[:, 2])
        if self.change_after:
            scores.zero_()  # one device's metrics took the values before
        return F.cross_entropy(logits, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("devices", [2, 3])
def test_metrics_that_draw_random_numbers_draw_them_in_the_order_the_step_updated_them(devices: int) -> None:
    one_device = _TwoBootstraps()
    trainer(max_epochs=2).fit(one_device, _data())
    for _ in range(2):
        split = _TwoBootstraps()
        trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(split, _data())
        for name in ("first", "second"):
            _assert_close(_states(getattr(split, name)), _states(getattr(one_device, name)), f"{name} states")
            _assert_close(getattr(split, name).compute(), getattr(one_device, name).compute(), f"{name}.compute()")


def test_an_argument_changed_in_place_after_the_update_stops_the_step_naming_it() -> None:
    model = _TwoBootstraps(change_after=True)
    before = parameters(model.layer)
    with pytest.raises(ReplicaStateError) as caught:
        trainer(max_steps=2, devices=2, strategy="mgpu_dp").fit(model, _data())
    assert caught.value.path == "self.second"
    assert "changed argument 1 of self.second.update in place after passing it" in str(caught.value)
    assert ".clone()" in str(caught.value)
    assert_same_parameters(before, parameters(model.layer), atol=0)


def _mean_loss(logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return (F.cross_entropy(logits, batch[1]),)


def test_a_mean_of_each_replicas_mean_loss_is_one_devices_when_the_chunks_have_equal_rows() -> None:
    even = DataLoader(torch.utils.data.Subset(_data().dataset, range(20)), batch_size=4)  # 2 + 2 rows per step
    one_device = _UpdatesInStep(torchmetrics.MeanMetric().double(), arguments=_mean_loss)
    trainer(max_epochs=1).fit(one_device, even)
    split = _UpdatesInStep(torchmetrics.MeanMetric().double(), arguments=_mean_loss)
    trainer(max_epochs=1, devices=2, strategy="mgpu_dp").fit(split, even)
    _assert_close(split.metric.compute(), one_device.metric.compute(), "compute()")


def _mismatched(logits: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return logits[:, 0], logits[:, :2]


def test_a_metrics_own_error_is_raised_with_torchmetrics_message_for_the_whole_batch() -> None:
    errors = []
    for settings in ({}, {"devices": 2, "strategy": "mgpu_dp"}):
        with pytest.raises(RuntimeError) as caught:
            trainer(max_steps=1, **settings).fit(_UpdatesInStep(torchmetrics.MeanSquaredError(), _mismatched), _data())
        errors.append(caught.value)
    assert type(errors[1]) is type(errors[0])
    assert str(errors[1]) == str(errors[0])
    assert "torch.Size([5, 2])" in str(errors[0])


def test_a_min_max_metrics_minimum_and_maximum_are_in_no_checkpoint() -> None:
    metric = wrappers.MinMaxMetric(torchmetrics.MeanSquaredError())
    metric(torch.ones(3), torch.zeros(3))
    assert not {"min_val", "max_val"} & set(metric.metric_state)
    assert not any(key.endswith(("min_val", "max_val")) for key in metric.state_dict())
    assert float(metric.max_val) == 1.0  # held, in a plain attribute


class _MockedUpdate(_UpdatesInStep):
    def __init__(self) -> None:
        super().__init__(classification.MulticlassAccuracy(3))
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        logits = self.layer(batch[0])
        self.metric.update(logits, batch[1])
        return F.cross_entropy(logits, batch[1])


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_a_mock_on_a_metrics_update_sees_one_device_s_calls(devices: int) -> None:
    model = _MockedUpdate()
    with mock.patch.object(model.metric, "update", wraps=model.metric.update) as update:
        trainer(max_epochs=1, devices=devices, strategy="mgpu_dp").fit(model, _data())
    assert update.call_count == 5  # one per step, with the whole batch
    assert [call.args[0].shape[0] for call in update.call_args_list] == [5, 5, 5, 5, 3]
    one_device = _MockedUpdate()
    trainer(max_epochs=1).fit(one_device, _data())
    torch.testing.assert_close(model.metric.compute(), one_device.metric.compute())
    assert model.metric.update_count == one_device.metric.update_count == 5


def test_the_same_metric_updated_in_training_step_end_is_left_to_the_module() -> None:
    one_device = _UpdatesInStepEnd(torchmetrics.regression.PearsonCorrCoef().double())
    one = trainer(devices=1, strategy="mgpu_dp", max_epochs=2)
    one.fit(one_device, _data())
    split = _UpdatesInStepEnd(torchmetrics.regression.PearsonCorrCoef().double())
    trainer(devices=2, strategy="mgpu_dp", max_epochs=2).fit(split, _data())
    torch.testing.assert_close(split.metric.compute(), one_device.metric.compute())


class _CallsInStep(_UpdatesInStep):
    def __init__(self, call: Callable[[torchmetrics.Metric], Any]) -> None:
        super().__init__(classification.MulticlassAccuracy(3))
        self.call = call

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.layer(batch[0])
        self.metric.update(logits, batch[1])
        self.call(self.metric)
        return F.cross_entropy(logits, batch[1])


class _Inspects(_UpdatesInStep):
    """Looks at its metric in the step, as code that checks what it was given does."""

    def __init__(self) -> None:
        super().__init__(classification.MulticlassAccuracy(3))
        self.seen: list[tuple[Any, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.layer(batch[0])
        metric = self.metric
        self.seen.append(
            (
                type(metric).__name__,
                isinstance(metric, classification.MulticlassAccuracy),
                metric.update.__name__,
                metric.update.__doc__,
                str(inspect.signature(metric.update)),
                metric.compute.__name__,
                metric.reset.__doc__,
                metric.num_classes,
                metric.average,
            )
        )
        metric.update(logits, batch[1])
        return F.cross_entropy(logits, batch[1])


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_a_metric_looked_at_in_the_step_reads_as_on_one_device_and_the_users_is_left_as_it_was(devices: int) -> None:
    one_device = _Inspects()
    trainer(max_steps=2).fit(one_device, _data())
    model = _Inspects()
    methods = {name: model.metric.__dict__[name] for name in ("update", "compute")}
    trainer(max_steps=2, devices=devices, strategy="mgpu_dp").fit(model, _data())
    assert model.seen[-1] == one_device.seen[-1]
    assert {name: model.metric.__dict__[name] for name in ("update", "compute")} == methods
    assert "reset" not in model.metric.__dict__
    assert not model.metric._forward_hooks
    assert not model.metric._forward_pre_hooks
    torch.testing.assert_close(model.metric.compute(), one_device.metric.compute())


@pytest.mark.parametrize("method", ["compute", "reset"])
def test_compute_or_reset_inside_a_replica_is_refused_with_the_fix(method: str) -> None:
    model = _CallsInStep(lambda metric: getattr(metric, method)())
    with pytest.raises(ReplicaStateError) as caught:
        trainer(devices=2, strategy="mgpu_dp", max_steps=1).fit(model, _data())
    assert caught.value.path == "self.metric"
    assert f"self.metric.{method}() inside replica" in str(caught.value)
    assert "*_step_end" in str(caught.value)


class _MetricInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.auroc = classification.MulticlassAUROC(3)
        self.cat = torchmetrics.CatMetric()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x)
        self.auroc.update(logits.softmax(-1), y)
        self.cat.update(logits[:, 1])
        return logits


def test_metrics_inside_the_drop_in_wrapper_end_as_on_one_device() -> None:
    one_device, split = _MetricInForward(), _MetricInForward()
    wrapper = MGPUDataParallel(split, [torch.device("cpu")] * 3)
    try:
        for x, y, *_ in _data():
            torch.testing.assert_close(wrapper(x, y), one_device(x, y))
    finally:
        wrapper.close()
    torch.testing.assert_close(split.auroc.compute(), one_device.auroc.compute())
    torch.testing.assert_close(split.cat.compute(), one_device.cat.compute())


# --------------------------------------------------------------------------------------------- plain state


class _Collects(MGPUMixin, L.LightningModule):
    """Lightning 2.x's pattern for epoch-end code: the step appends to a list the epoch-end hook reads."""

    def __init__(self, collect: str = "rows") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()
        self.collect = collect
        self.outputs: list[Any] = []
        self.epoch_values: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self.layer(batch[0])
        if self.collect == "rows":
            self.outputs.append(
                {"preds": logits.argmax(-1), "errors": F.cross_entropy(logits, batch[1], reduction="none")}
            )
        else:
            self.outputs.append(F.cross_entropy(logits, batch[1]))

    def on_validation_epoch_end(self) -> None:
        self.epoch_values.append(torch.cat([output["errors"] for output in self.outputs]))
        self.outputs.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _ListLengths(L.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_validation_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        self.seen.append(len(module.outputs))


@pytest.mark.parametrize("devices", [2, 3])
def test_a_list_the_step_appends_per_row_values_to_gets_one_item_per_step_as_on_one_device(devices: int) -> None:
    one_device = _Collects()
    trainer(max_epochs=2).fit(one_device, _data(), _data(seed=1))
    for _ in range(2):
        split = _Collects()
        lengths = _ListLengths()
        trainer(max_epochs=2, devices=devices, strategy="mgpu_dp", callbacks=[lengths]).fit(split, _data(), _data(1))
        assert lengths.seen[:5] == [1, 2, 3, 4, 5]  # one item per step, not one per replica
        for values, wanted in zip(split.epoch_values, one_device.epoch_values, strict=True):
            torch.testing.assert_close(values, wanted)


class _EpochEndMean(L.LightningModule):
    """Lightning 2.x's documented epoch-end pattern: each step's loss appended, their mean taken at the epoch's end."""

    def __init__(self, append: str = "loss") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.append = append
        self.layer = nn.Linear(4, 3).double()
        self.validation_step_outputs: list[torch.Tensor] = []
        self.epoch_means: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        loss = F.cross_entropy(self.layer(x), y)
        if self.append == "dict":  # Lightning's checkpointing tests append a dict of the step's values
            self.validation_step_outputs.append(
                {"x": loss, "rows": F.cross_entropy(self.layer(x), y, reduction="none")}
            )
        else:
            self.validation_step_outputs.append(loss if self.append == "loss" else torch.tensor(len(x)))

    def on_validation_epoch_end(self) -> None:
        if self.append == "dict":
            losses = [output["x"] for output in self.validation_step_outputs]
            rows = torch.cat([output["rows"] for output in self.validation_step_outputs])
            self.epoch_means.append(torch.stack([torch.stack(losses).mean(), rows.mean()]))
        else:
            self.epoch_means.append(torch.stack(self.validation_step_outputs).double().mean())
        self.validation_step_outputs.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("append", ["loss", "dict"])
@pytest.mark.parametrize("devices", [2, 3])
def test_a_loss_appended_per_step_and_averaged_at_the_epochs_end_equals_one_device(devices: int, append: str) -> None:
    one_device = _EpochEndMean(append)
    trainer(max_epochs=2).fit(one_device, _data(), _data(seed=1))
    for _ in range(2):
        split = _EpochEndMean(append)
        trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(split, _data(), _data(1))
        assert len(split.epoch_means) == len(one_device.epoch_means) == 2
        for value, wanted in zip(split.epoch_means, one_device.epoch_means, strict=True):
            torch.testing.assert_close(value, wanted, atol=1e-6, rtol=0)


def test_appending_a_count_of_the_replicas_rows_to_a_list_is_refused_naming_the_list() -> None:
    model = _EpochEndMean(append="count")
    with pytest.raises(
        ReplicaStateError, match=r"appended to self\.validation_step_outputs.*differ \(tensor\(3\)"
    ) as caught:
        trainer(max_steps=1, devices=2, strategy="mgpu_dp", num_sanity_val_steps=1).fit(model, _data(), _data())
    assert caught.value.path == "self.validation_step_outputs[-1]"
    assert caught.value.step == "validation_step"
    assert model.validation_step_outputs == []


class _Writes(nn.Module):
    def __init__(self, write: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        self.write = write
        self.seen_ids: set[int] = set()
        self.cache: dict[str, torch.Tensor] = {}
        self.total = torch.zeros((), dtype=torch.float64)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.write == "set":
            self.seen_ids.update(ids.tolist())
        elif self.write == "dict":
            self.cache["last"] = x
        else:
            self.total += x.sum()
        return self.layer(x)


def test_a_set_the_replicas_add_to_gets_every_addition() -> None:
    model = _Writes("set")
    wrapper = MGPUDataParallel(model, [torch.device("cpu")] * 3)
    try:
        for x, _, query, _ in _data():
            wrapper(x, query)
    finally:
        wrapper.close()
    assert model.seen_ids == set(range(ROWS // 3 + 1))


@pytest.mark.parametrize(("write", "path"), [("dict", "self.cache['last']"), ("tensor", "self.total")])
def test_a_dict_key_set_from_each_replicas_rows_or_a_plain_tensor_changed_in_place_is_refused(
    write: str, path: str
) -> None:
    model = _Writes(write)
    wrapper = MGPUDataParallel(model, CPU2)
    try:
        with pytest.raises(ReplicaStateError) as caught:
            wrapper(torch.randn(4, 4, dtype=torch.float64), torch.arange(4))
    finally:
        wrapper.close()
    assert caught.value.path == path
    assert caught.value.step == "forward"
    assert model.cache == {}


class _Caches(nn.Module):
    """Keeps values per sample and a cache of masks by shape in plain dicts, filled in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        self.per_sample: dict[int, float] = {}
        self.masks: dict[int, torch.Tensor] = {}
        self.counts = {"steps": 0}

    def forward(self, x: torch.Tensor, ids: torch.Tensor, count: bool = False) -> torch.Tensor:
        out = self.layer(x).squeeze(1)
        for sample, value in zip(ids.tolist(), out.tolist(), strict=True):
            self.per_sample[sample] = value
        if x.shape[0] not in self.masks:
            self.masks[x.shape[0]] = torch.ones(x.shape[0], dtype=torch.bool)
        if count:
            self.counts["steps"] += 1
        return out


def test_keys_the_replicas_add_to_a_dict_reach_the_module_and_a_changed_key_is_refused() -> None:
    one_device, split = _Caches(), _Caches()
    split.load_state_dict(one_device.state_dict())
    wrapper = MGPUDataParallel(split, [torch.device("cpu")] * 3)
    try:
        for x, _, query, _ in _data():
            wrapper(x, torch.arange(len(query)) + 10 * query)
            one_device(x, torch.arange(len(query)) + 10 * query)
        assert split.per_sample == pytest.approx(one_device.per_sample, abs=1e-12)
        assert sorted(split.masks) == [1, 2]  # every replica's cache entry: chunks of 2, 2, 1 and 1, 1, 1 rows
        with pytest.raises(ReplicaStateError) as caught:
            wrapper(torch.randn(4, 4, dtype=torch.float64), torch.arange(1000, 1004), count=True)
    finally:
        wrapper.close()
    assert caught.value.path == "self.counts"
    assert split.counts == {"steps": 0}


class _Retrieval(MGPUMixin, L.LightningModule):
    """Keeps its metrics registered under their own names, and indexes them in a plain dict as well."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1).double()
        self.mrr = retrieval.RetrievalMRR()
        self.hit_rate = retrieval.RetrievalHitRate()
        self.evaluators = {"mrr": self.mrr, "hit_rate": self.hit_rate}
        self.layers = [self.layer]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, query, relevant = batch
        scores = self.layers[0](x).squeeze(1)
        for metric in self.evaluators.values():
            metric.update(scores.detach(), relevant, indexes=query)
        return F.binary_cross_entropy_with_logits(scores, relevant.to(scores.dtype))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_plain_dict_indexing_registered_metrics_is_no_finding_and_reaches_each_replicas_own() -> None:
    assert check_model(_Retrieval()) == []
    one_device = _Retrieval()
    trainer(max_epochs=2).fit(one_device, _data())
    split = _Retrieval()
    trainer(max_epochs=2, devices=3, strategy="mgpu_dp").fit(split, _data())
    assert_same_parameters(parameters(one_device), parameters(split))
    for name in ("mrr", "hit_rate"):
        torch.testing.assert_close(getattr(split, name).compute(), getattr(one_device, name).compute())
    assert split.evaluators["mrr"] is split.mrr


def test_a_replica_reads_its_own_modules_and_parameters_through_a_plain_container() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Parameter(torch.ones(1))
            self.head = nn.Linear(1, 1)
            self.pair = [self.first, {"head": self.head}]

    model = Pair()
    assert check_model(model) == []
    replicas = replicate(model, CPU2)
    for replica in replicas:
        assert replica.pair[0] is replica.first
        assert replica.pair[1]["head"] is replica.head
    assert replicas[0].pair is not model.pair
    assert model.pair[0] is model.first


def test_what_a_step_writes_outside_the_module_is_written_once_per_replica() -> None:
    """What replicas share and the package cannot copy (loggers, files, globals, closures) is the code's to handle."""
    written: list[int] = []

    class WritesOutside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            written.append(x.shape[0])  # a logger's experiment, a file: the same object for every replica
            return self.layer(x)

    wrapper = MGPUDataParallel(WritesOutside(), [torch.device("cpu")] * 3)
    try:
        wrapper(torch.randn(7, 4))
    finally:
        wrapper.close()
    assert sorted(written) == [2, 2, 3]  # once per replica, in whatever order their threads ran


class _ClassLevelList(L.LightningModule):
    """Per-row values appended to a list in the class body, reached through self, as a notebook often keeps them."""

    rows: list[torch.Tensor] = []  # noqa: RUF012 - the class-level container this test is about
    seen: dict[int, set[int]] = {}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        self.rows.append(x[:, 0] * 2)
        self.seen.setdefault(batch_idx, set()).add(x.shape[0] + getattr(self, "replica_index", 0) * 100)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_containers_in_class_attributes_and_containers_set_at_one_key_end_as_on_one_device(devices: int) -> None:
    """A class-level list gets one item per step in batch order; sets the replicas create at one key are united."""
    x = torch.randn(ROWS, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x), batch_size=BATCH)
    for _ in range(2):
        _ClassLevelList.rows, _ClassLevelList.seen = [], {}
        model = _ClassLevelList()
        trainer(strategy="mgpu_dp" if devices > 1 else "auto", devices=devices).fit(model, data)
        assert "rows" not in vars(model)
        assert "seen" not in vars(model)
        assert len(_ClassLevelList.rows) == 5  # one item per step, as one device appends
        torch.testing.assert_close(torch.cat(_ClassLevelList.rows), x[:, 0] * 2, atol=0, rtol=0)
        # one device adds the batch's rows once; each replica adds its chunk's rows, tagged by its index
        chunks = [[3, 2], [2, 2, 1]][devices - 2] if devices > 1 else [BATCH]
        last = {1: [3], 2: [2, 1], 3: [1, 1, 1]}[devices]
        expected = {index: {rows + replica * 100 for replica, rows in enumerate(chunks)} for index in range(4)}
        expected[4] = {rows + replica * 100 for replica, rows in enumerate(last)}
        assert _ClassLevelList.seen == expected


class _StoredStep(L.LightningModule):
    """Its training step stored on the instance, as a bound method, a partial of one, or a closure."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        if how == "partial":
            self.training_step = functools.partial(self._step, scale=2.0)
        elif how == "bound":
            self.training_step = self._step
        else:
            step = self._step

            def closure(batch: Any, batch_idx: int) -> torch.Tensor:
                return step(batch, batch_idx)

            self.training_step = closure

    def _step(self, batch: Any, batch_idx: int, scale: float = 1.0) -> torch.Tensor:
        x = batch[0]
        self.log("rows", float(len(x)), reduce_fx="sum")
        loss = scale * self.layer(x).pow(2).mean()
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_stored(how: str, devices: int) -> tuple[dict[str, torch.Tensor], float, torch.Tensor]:
    torch.manual_seed(0)
    model = _StoredStep(how)
    run = trainer(strategy="mgpu_dp" if devices > 1 else "auto", devices=devices)
    x = torch.randn(ROWS, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    run.fit(model, DataLoader(TensorDataset(x), batch_size=BATCH))
    return parameters(model), float(run.callback_metrics["rows"]), model.last_loss


@pytest.mark.parametrize("how", ["partial", "bound"])
def test_a_step_stored_on_the_instance_runs_on_each_replica_as_on_one_device(how: str) -> None:
    one_device, rows, last_loss = _fit_stored(how, 1)
    assert rows == 3.0  # the last batch's rows
    for devices in (2, 3):
        for _ in range(2):
            split, split_rows, split_last_loss = _fit_stored(how, devices)
            assert_same_parameters(split, one_device)
            assert split_rows == rows
            torch.testing.assert_close(split_last_loss, last_loss, atol=1e-6, rtol=0)


def test_a_stored_step_that_calls_the_module_itself_is_refused_before_the_first_step() -> None:
    torch.manual_seed(0)
    model = _StoredStep("closure")
    before = parameters(model)
    with pytest.raises(ReplicaStateError, match="stored on the module that calls the module itself") as raised:
        trainer(strategy="mgpu_dp", devices=2).fit(
            model, DataLoader(TensorDataset(torch.randn(8, 4).double()), batch_size=4)
        )
    assert raised.value.path == "self.training_step"
    assert "last_loss" not in vars(model)
    assert_same_parameters(parameters(model), before, atol=0)


def test_the_replicas_rows_of_a_detection_reach_the_metrics_device_inside_their_dicts() -> None:
    from lightning_mgpu.replica_state import metrics

    rows = [[{"boxes": torch.ones(1, 4), "labels": torch.zeros(1, dtype=torch.long)}] for _ in range(2)]
    joined = metrics._join(rows, [1, 1], torch.device("meta"), "argument 1")
    assert len(joined) == 2
    assert {tensor.device.type for row in joined for tensor in row.values()} == {"meta"}
