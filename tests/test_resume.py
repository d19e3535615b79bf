"""Kill a run with SIGKILL from outside, mid-epoch or after an epoch, resume it: nothing differs from a straight run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from models import (
    DatasetStateLoader,
    PositionKeepingLoader,
    RegressionStream,
    Regressor,
    RegressorSteps,
    SizedStatefulRegressionStream,
    StatefulRegressionStream,
    StepEndRegressor,
    assert_same_parameters,
    loader,
    parameters,
    regression_data,
    trainer,
)
from processes import clean_env, free_port
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_mgpu import EpochRestartWarning

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"


def _command(out: Path, options: list[str], *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--out", str(out), *options, *extra]


def _straight(out: Path, options: list[str]) -> None:
    env = clean_env(MASTER_PORT=str(free_port()))
    result = subprocess.run(_command(out, options), env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def _kill_after(out: Path, options: list[str], checkpoint: str) -> Path:
    """Start the run, wait for ``checkpoint`` to be written, then SIGKILL every process of the run."""
    env = clean_env(MASTER_PORT=str(free_port()))
    process = subprocess.Popen(
        _command(out, options, "--sleep", "0.25"), env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    target = out / "checkpoints" / checkpoint
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.4)  # let the run go on past the checkpoint, so the kill lands mid-step
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert target.exists(), process.stderr.read() if process.stderr else ""
    assert process.returncode == -signal.SIGKILL
    assert not (out / "final.pt").exists(), "the run finished before it could be killed"
    return target


def _resume(out: Path, options: list[str], checkpoint: Path) -> None:
    env = clean_env(MASTER_PORT=str(free_port()))
    result = subprocess.run(
        _command(out, options, "--ckpt-in", str(checkpoint)), env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _final(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return torch.load(out / "final.pt", weights_only=False), json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "every", "checkpoint", "loader"),
    [
        pytest.param(strategy, every, checkpoint, loader, id=f"{strategy}-{name}")
        for strategy in ("mgpu_dp", "mgpu_ddp")
        # step 13 is in the middle of the second epoch (10 steps per epoch)
        for name, every, checkpoint, loader in [
            ("mid-epoch", 13, "step=13.ckpt", "DataLoader"),
            ("epoch-end", 0, "step=10.ckpt", "DataLoader"),
            ("mid-epoch-position-keeping-loader", 13, "step=13.ckpt", "PositionKeepingLoader"),
        ]
        if strategy == "mgpu_ddp" or loader == "DataLoader"  # mgpu_dp's is in-process, below
    ],
)
def test_sigkill_and_resume_matches_a_straight_run(
    tmp_path: Path, strategy: str, every: int, checkpoint: str, loader: str
) -> None:
    options = ["--strategy", strategy, "--every", str(every)]
    options += ["--position-keeping"] if loader == "PositionKeepingLoader" else []
    _straight(tmp_path / "straight", options)
    saved = _kill_after(tmp_path / "killed", options, checkpoint)
    _resume(tmp_path / "resumed", options, saved)

    straight, straight_report = _final(tmp_path / "straight")
    resumed, resumed_report = _final(tmp_path / "resumed")
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0, msg=name)
    for index, state in straight["optimizer"]["state"].items():
        torch.testing.assert_close(
            resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"], atol=1e-6, rtol=0
        )
    resumed_losses = resumed_report["losses"]
    assert resumed_losses, "the resumed run trained"
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(straight_report["losses"][step], abs=1e-6), f"loss at step {step}"
    assert resumed_report["metrics"]["loss_epoch"] == pytest.approx(straight_report["metrics"]["loss_epoch"], abs=1e-6)


class _MetricLogged(StepEndRegressor):
    """Logs a torchmetrics object at epoch level from training_step_end, as 1.x DP code did."""

    def __init__(self) -> None:
        super().__init__()
        self.error_mean = torchmetrics.MeanMetric()
        self.largest = torchmetrics.MaxMetric()

    def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
        self.error_mean(step_output["errors"])
        self.largest(step_output["errors"])
        self.log("error_mean", self.error_mean, on_step=False, on_epoch=True)
        self.log("largest", self.largest, on_step=False, on_epoch=True)
        return step_output["errors"].mean()


@pytest.mark.parametrize("devices", [1, 2])
def test_torchmetrics_epoch_values_continue_after_a_mid_epoch_resume(tmp_path: Path, devices: int) -> None:
    def fit(ckpt_path: str | None = None, **overrides: Any) -> L.Trainer:
        run = trainer(tmp_path, max_epochs=1, devices=devices, strategy="mgpu_dp", **overrides)
        run.fit(_MetricLogged(), loader(regression_data(), 4), ckpt_path=ckpt_path)
        return run

    every_third = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    straight = fit(callbacks=[every_third], enable_checkpointing=True)
    resumed = fit(str(tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"))
    for name in ("error_mean", "largest"):
        torch.testing.assert_close(resumed.callback_metrics[name], straight.callback_metrics[name], atol=1e-6, rtol=0)


class _OrderRecordedSteps(RegressorSteps):
    """Records each step's sample indices; its learning rate can follow the run's total steps (``OneCycleLR``)."""

    def __init__(self, one_cycle: bool) -> None:
        super().__init__()
        self.one_cycle = one_cycle
        self.steps: list[list[int]] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.steps.append(sorted(batch[2].tolist()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[:2], batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if not self.one_cycle:
            return optimizer
        total = self.trainer.estimated_stepping_batches  # sets the training data up before the checkpoint is loaded
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class _OrderRecorded(_OrderRecordedSteps, L.LightningModule):
    """``_OrderRecordedSteps`` on ``lightning.pytorch``."""


class _PLOrderRecorded(_OrderRecordedSteps, pl.LightningModule):
    """``_OrderRecordedSteps`` on ``pytorch_lightning``."""


@pytest.mark.parametrize("lightning", [L, pl], ids=["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("one_cycle", [False, True], ids=["fixed-lr", "estimated_stepping_batches"])
@pytest.mark.parametrize("loader_class", [DataLoader, PositionKeepingLoader])
def test_mid_epoch_resume_trains_on_the_rest_of_the_epoch_in_its_order(
    tmp_path: Path, loader_class: type[DataLoader], one_cycle: bool, lightning: Any
) -> None:
    """A shuffled epoch resumed from step 15 of 20 sees the straight run's last 5 batches, whoever keeps the place.

    A DataLoader that keeps its own place by Lightning's protocol is left to it (skipping its batches again would
    leave nothing of the epoch), and its state reaches it even when ``configure_optimizers`` reads the run's total
    steps, which makes Lightning drop it. In either Lightning namespace.
    """
    x, y = regression_data(rows=40)[:]
    data = TensorDataset(x, y, torch.arange(40))

    def fit(ckpt_path: str | None = None, **overrides: Any) -> _OrderRecorded:
        torch.manual_seed(3)  # not seed_everything, whose PL_GLOBAL_SEED would seed later tests' DistributedSampler
        model = (_OrderRecorded if lightning is L else _PLOrderRecorded)(one_cycle)
        run = trainer(tmp_path, lightning.Trainer, max_epochs=2, devices=2, strategy="mgpu_dp", **overrides)
        run.fit(model, loader_class(data, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
        return model

    every_third = lightning.callbacks.ModelCheckpoint(tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    straight = fit(callbacks=[every_third], enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(str(tmp_path / "checkpoints" / "epoch=1-step=15.ckpt"))
        hiding = [entry for entry in warnings.filters if entry[1] is not None and "dataloader is" in entry[1].pattern]

    assert [str(warning.message) for warning in caught if "dataloader is not resumable" in str(warning.message)] == []
    assert hiding == []  # the filter that hid Lightning's warning while the epoch started is gone
    assert len(straight.steps) == 20
    assert resumed.steps == straight.steps[15:]
    for (name, value), resumed_value in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(resumed_value, value, atol=1e-6, rtol=0, msg=name)


_STREAMS: dict[str, tuple[type[RegressionStream], type[DataLoader]]] = {
    "stateful-loader": (StatefulRegressionStream, DatasetStateLoader),
    "stateful-loader-sized": (SizedStatefulRegressionStream, DatasetStateLoader),
    "stateless": (RegressionStream, DataLoader),
    "stateful-dataset-in-a-plain-loader": (StatefulRegressionStream, DataLoader),
}
"""An IterableDataset of 20 rows in batches of 4 (5 steps an epoch), and the DataLoader around it."""


def _fit_stream(
    folder: Path, stream: str, ckpt_path: Path | None = None, **overrides: Any
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Two epochs on ``stream``: the parameters after them and the warnings about resuming."""
    dataset_class, loader_class = _STREAMS[stream]
    model = Regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(folder, max_epochs=2, **overrides).fit(
            model, loader_class(dataset_class(), batch_size=4), ckpt_path=ckpt_path
        )
    return parameters(model), [str(warning.message) for warning in caught if "resum" in str(warning.message).lower()]


def _straight_and_resumed(
    tmp_path: Path, stream: str, every: int, checkpoint: str, **overrides: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """A run checkpointed every ``every`` steps, and one resumed from its ``checkpoint``, with their warnings."""
    name = overrides.get("strategy", "one-device")
    saving = ModelCheckpoint(tmp_path / name / "checkpoints", every_n_train_steps=every, save_top_k=-1)
    straight, _ = _fit_stream(tmp_path / name, stream, callbacks=[saving], enable_checkpointing=True, **overrides)
    saved = tmp_path / name / "checkpoints" / checkpoint
    resumed, warned = _fit_stream(tmp_path / f"{name}-resumed", stream, saved, **overrides)
    return straight, resumed, warned


@pytest.mark.parametrize("stream", list(_STREAMS))
def test_a_mid_epoch_resume_of_an_iterable_dataset_continues_where_one_device_continues(
    tmp_path: Path, stream: str
) -> None:
    """Resumed at step 8, the fourth batch of the second epoch, as one device resumes and with one warning at most.

    A DataLoader that checkpoints the dataset's position resumes after the batches done (exactly, when the dataset
    states its length; without one the fit loop has fetched one batch ahead, on one device too). Without it the epoch
    restarts from the dataset's first batch, as on one device, and a warning says so once.
    """
    single, single_resumed, _ = _straight_and_resumed(tmp_path, stream, 4, "epoch=1-step=8.ckpt")
    split, split_resumed, warned = _straight_and_resumed(
        tmp_path, stream, 4, "epoch=1-step=8.ckpt", devices=2, strategy="mgpu_dp"
    )
    assert_same_parameters(split, single)
    assert_same_parameters(split_resumed, single_resumed)
    if stream == "stateful-loader-sized":
        assert_same_parameters(split_resumed, split)
    if _STREAMS[stream][1] is DatasetStateLoader:
        assert warned == []
        return
    assert len(warned) == 1
    assert "after 3 batches of the epoch" in warned[0]
    assert f"IterableDataset {_STREAMS[stream][0].__name__}," in warned[0]
    assert ("StatefulRegressionStream.state_dict is not saved" in warned[0]) == (stream != "stateless")


def test_an_iterable_dataset_resumed_after_the_last_batch_of_an_epoch_continues_exactly(tmp_path: Path) -> None:
    """Without a length only the fit loop knows an epoch ended: the checkpoint after its last batch is not mid-epoch."""
    straight, resumed, warned = _straight_and_resumed(
        tmp_path, "stateless", 5, "epoch=0-step=5.ckpt", devices=2, strategy="mgpu_dp"
    )
    assert warned == []
    assert_same_parameters(resumed, straight)


class _FlavouredLoader(DataLoader):
    """Takes an ``__init__`` argument it does not keep, so Lightning cannot re-create it around another sampler."""

    def __init__(self, dataset: Any, flavour: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)


class _KeptFlavourLoader(_FlavouredLoader):
    """``_FlavouredLoader`` with its argument kept as an attribute of the same name: Lightning can re-create it."""

    def __init__(self, dataset: Any, flavour: str, **kwargs: Any) -> None:
        super().__init__(dataset, flavour, **kwargs)
        self.flavour = flavour


class _SeedAtTrainStart(L.Callback):
    """Seeds the global RNG where one device and ``mgpu_dp`` stand alike, so a shuffled restart draws one order."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.manual_seed(7)


def _fit_flavoured(
    folder: Path, loader_class: type[DataLoader], shuffle: bool, ckpt_path: Path | None = None, **overrides: Any
) -> tuple[dict[str, torch.Tensor], list[warnings.WarningMessage], bool]:
    """Two epochs of 5 steps: the parameters, the warnings about resuming, and whether the loader trained as given."""
    model = Regressor()
    data = loader_class(regression_data(), "vanilla", batch_size=4, shuffle=shuffle)
    saving = ModelCheckpoint(folder / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    run = trainer(folder, max_epochs=2, callbacks=[saving, _SeedAtTrainStart()], enable_checkpointing=True, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, data, ckpt_path=ckpt_path)
    about_resuming = [
        warning
        for warning in caught
        if isinstance(warning.message, EpochRestartWarning) or "resuming" in str(warning.message).lower()
    ]
    return parameters(model), about_resuming, run.train_dataloader is data


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_a_loader_that_cannot_be_re_created_trains_and_resumes_as_on_one_device(tmp_path: Path, shuffle: bool) -> None:
    """Trained as given, equal to one device; its mid-epoch checkpoint restarts the epoch, as one device's does.

    Saved at steps 3, 6 and 9 and resumed at step 6 (1 batch into the second epoch, saving at step 9 again), each run
    warns once, naming the loader and why it is not re-created.
    """
    single, _, _ = _fit_flavoured(tmp_path / "one-device", _FlavouredLoader, shuffle)
    saved = tmp_path / "one-device" / "checkpoints" / "epoch=1-step=6.ckpt"
    single_resumed, _, _ = _fit_flavoured(tmp_path / "one-device-resumed", _FlavouredLoader, shuffle, saved)
    for attempt in range(2):
        folder = tmp_path / f"mgpu_dp-{attempt}"
        split, warned, as_given = _fit_flavoured(folder, _FlavouredLoader, shuffle, devices=2, strategy="mgpu_dp")
        assert as_given
        assert_same_parameters(split, single)
        split_resumed, warned_resumed, _ = _fit_flavoured(
            tmp_path / f"mgpu_dp-{attempt}-resumed", _FlavouredLoader, shuffle,
            folder / "checkpoints" / "epoch=1-step=6.ckpt", devices=2, strategy="mgpu_dp",
        )  # fmt: skip
        assert_same_parameters(split_resumed, single_resumed)
        for caught in (warned, warned_resumed):
            assert [warning.category for warning in caught] == [EpochRestartWarning]
            message = caught[0].message
            assert isinstance(message, EpochRestartWarning)
            assert message.loader == "_FlavouredLoader"
            assert "['flavour']" in message.cause
    assert str(message) == (
        f"The training DataLoader _FlavouredLoader is not re-created around a sampler that records its epoch's order"
        f" ({message.cause}), so it trains as given, as on one device, and a run resumed from a mid-epoch checkpoint"
        " restarts that epoch from the loader's first batch (in a new order if it shuffles), as Lightning does,"
        " instead of continuing it. To resume exactly, keep every __init__ argument of _FlavouredLoader as an"
        " attribute of the same name, or give it Lightning's state_dict/load_state_dict protocol (torchdata's"
        " StatefulDataLoader), or resume from an end-of-epoch checkpoint."
    )


def test_a_shuffled_epoch_saved_without_its_seed_restarts_even_when_the_loader_can_now_be_re_created(
    tmp_path: Path,
) -> None:
    """The order of the interrupted epoch is unknown, so no batch is skipped: the epoch restarts, as on one device.

    Its checkpoints hold the order again: resumed from the one at step 9, saved by the resumed run, it ends where that
    run ended.
    """
    folder = tmp_path / "saved"
    _fit_flavoured(folder, _FlavouredLoader, True, devices=2, strategy="mgpu_dp")
    saved = folder / "checkpoints" / "epoch=1-step=6.ckpt"
    single_resumed, _, _ = _fit_flavoured(tmp_path / "one-device", _KeptFlavourLoader, True, saved)
    for attempt in range(2):
        split_resumed, warned, _ = _fit_flavoured(
            tmp_path / f"mgpu_dp-{attempt}", _KeptFlavourLoader, True, saved, devices=2, strategy="mgpu_dp"
        )
        assert_same_parameters(split_resumed, single_resumed)
        assert [warning.category for warning in warned] == [EpochRestartWarning]
        message = warned[0].message
        assert isinstance(message, EpochRestartWarning)
        assert (message.loader, message.cause) == (
            "_KeptFlavourLoader",
            "the checkpoint holds nothing that tells its epoch's order (a seed or a generator's state)",
        )
        assert "after 1 batch of the epoch" in str(message)
        again = tmp_path / f"mgpu_dp-{attempt}" / "checkpoints" / "epoch=1-step=9.ckpt"
        resumed_again, warned, _ = _fit_flavoured(
            tmp_path / f"mgpu_dp-{attempt}-again", _KeptFlavourLoader, True, again, devices=2, strategy="mgpu_dp"
        )
        assert warned == []
        assert_same_parameters(resumed_again, split_resumed)


def test_a_sequential_loader_is_the_one_trained_on_and_resumes_exactly(tmp_path: Path) -> None:
    """Its order needs no seed: a run not resumed mid-epoch iterates the given loader, a resumed one skips exactly."""
    x, y = regression_data(rows=40)[:]
    data = TensorDataset(x, y, torch.arange(40))

    def fit(folder: Path, ckpt_path: Path | None = None) -> tuple[_OrderRecorded, bool, list[str]]:
        model = _OrderRecorded(one_cycle=False)
        given = DataLoader(data, batch_size=4)
        saving = ModelCheckpoint(folder / "checkpoints", every_n_train_steps=3, save_top_k=-1)
        run = trainer(
            folder, max_epochs=2, devices=2, strategy="mgpu_dp", callbacks=[saving], enable_checkpointing=True
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(model, given, ckpt_path=ckpt_path)
        return (
            model,
            run.train_dataloader is given,
            [
                str(w.message)
                for w in caught
                if "checkpoint that ended" in str(w.message) or isinstance(w.message, EpochRestartWarning)
            ],
        )

    for attempt in range(2):
        straight, as_given, warned = fit(tmp_path / f"straight-{attempt}")
        assert as_given
        assert warned == []
        resumed, _, warned = fit(
            tmp_path / f"resumed-{attempt}", tmp_path / "straight-0/checkpoints/epoch=1-step=15.ckpt"
        )
        assert warned == []
        assert len(straight.steps) == 20
        assert resumed.steps == straight.steps[15:]
        for (name, value), resumed_value in zip(straight.named_parameters(), resumed.parameters(), strict=True):
            torch.testing.assert_close(resumed_value, value, atol=1e-6, rtol=0, msg=name)


_RANDOM_SAMPLERS: dict[str, Any] = {
    "weighted-global-rng": lambda: WeightedRandomSampler(torch.linspace(1.0, 2.0, 40), num_samples=40),
    "subset-global-rng": lambda: SubsetRandomSampler(list(range(40))),
    "subset-own-generator": lambda: SubsetRandomSampler(list(range(40)), generator=torch.Generator().manual_seed(5)),
    "random-own-generator": lambda: RandomSampler(range(40), generator=torch.Generator().manual_seed(5)),
}
"""Samplers whose order comes from a torch generator other than a seed RandomSampler draws: each its own kind."""


@pytest.mark.parametrize("make_sampler", list(_RANDOM_SAMPLERS.values()), ids=list(_RANDOM_SAMPLERS))
def test_a_mid_epoch_resume_repeats_the_order_of_any_torch_random_sampler(tmp_path: Path, make_sampler: Any) -> None:
    """The epoch resumed from step 15 of 20 trains on the straight run's last 5 batches, in their order."""
    x, y = regression_data(rows=40)[:]
    data = TensorDataset(x, y, torch.arange(40))

    def fit(ckpt_path: str | None = None, **overrides: Any) -> _OrderRecorded:
        torch.manual_seed(3)
        model = _OrderRecorded(one_cycle=False)
        run = trainer(tmp_path, max_epochs=2, devices=2, strategy="mgpu_dp", **overrides)
        run.fit(model, DataLoader(data, batch_size=4, sampler=make_sampler()), ckpt_path=ckpt_path)
        return model

    every_third = L.callbacks.ModelCheckpoint(tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    straight = fit(callbacks=[every_third], enable_checkpointing=True)
    resumed = fit(str(tmp_path / "checkpoints" / "epoch=1-step=15.ckpt"))

    assert len(straight.steps) == 20
    assert straight.steps[10:15] != straight.steps[:5]  # the order changes between epochs
    assert resumed.steps == straight.steps[15:]
    for (name, value), resumed_value in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(resumed_value, value, atol=1e-6, rtol=0, msg=name)
