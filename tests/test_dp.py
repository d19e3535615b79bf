"""mgpu_dp with virtual replicas on the CPU must train, evaluate and predict exactly like one device."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import lightning as L
import pytest
import torch
from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser
from models import (
    DictBacked,
    KeywordsOnly,
    RegressionStream,
    Regressor,
    StepEndRegressor,
    assert_same_parameters,
    loader,
    parameters,
    regression_data,
    trainer,
)
from torch import nn
from torch.utils.data import DataLoader, default_collate

import lightning_mgpu
from lightning_mgpu import MGPUDPStrategy, ReplicaStateError
from lightning_mgpu.errors import ConfigurationError, GatherError
from lightning_mgpu.strategies import pytorch_lightning as bound


def _fit(
    model: L.LightningModule, batch_size: int, ckpt_path: str | None = None, val: bool = False, **trainer_kwargs: Any
) -> L.Trainer:
    fit_trainer = trainer(**trainer_kwargs)
    val_loader = loader(regression_data(rows=7, seed=3), 3) if val else None
    fit_trainer.fit(model, loader(regression_data(), batch_size), val_loader, ckpt_path=ckpt_path)
    return fit_trainer


@pytest.mark.parametrize("model_class", [Regressor, StepEndRegressor])
@pytest.mark.parametrize(
    ("devices", "batch_size"),
    [(2, 4), (2, 5), (3, 5), (4, 3)],
    ids=["even-2x2", "uneven-3+2", "uneven-2+2+1", "fewer-rows-than-devices"],
)
@pytest.mark.parametrize("strategy", ["mgpu_dp", "instance"])
def test_parameters_match_single_device(model_class: type, devices: int, batch_size: int, strategy: str) -> None:
    single = Regressor()  # computes in training_step what StepEndRegressor computes in training_step_end
    _fit(single, batch_size, max_epochs=2)
    parallel = model_class()
    chosen = MGPUDPStrategy() if strategy == "instance" else strategy
    _fit(parallel, batch_size, max_epochs=2, devices=devices, strategy=chosen)
    assert_same_parameters(parameters(single), parameters(parallel))
    assert not torch.equal(parameters(single)["net.0.weight"], parameters(Regressor())["net.0.weight"])


def test_replicas_run_in_their_own_threads_with_their_index() -> None:
    seen: list[tuple[int, int, str, torch.device]] = []

    class Recorder(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((self.replica_index, self.num_replicas, threading.current_thread().name, self.device))
            assert all(not p.is_leaf for p in self.parameters()), "replica parameters are aliases of the originals"
            return super().training_step(batch, batch_idx)

    _fit(Recorder(), 10, devices=2, strategy="mgpu_dp", max_steps=1)
    assert sorted(entry[:2] for entry in seen) == [(0, 2), (1, 2)]
    assert len({entry[2] for entry in seen}) == 2
    assert threading.current_thread().name not in {entry[2] for entry in seen}
    assert {entry[3] for entry in seen} == {torch.device("cpu")}


def test_outside_replicas_the_module_is_replica_0_of_1() -> None:
    seen: list[tuple[int, int]] = []

    class Recorder(StepEndRegressor):
        def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append((self.replica_index, self.num_replicas))
            return super().training_step_end(step_output)

    _fit(Recorder(), 10, devices=2, strategy="mgpu_dp", max_steps=1)
    assert seen == [(0, 1)]


def test_gathered_output_keeps_replica_order_and_dtype() -> None:
    gathered: list[Any] = []

    class Indexed(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            return {
                "loss": torch.nn.functional.mse_loss(self(x), y),
                "index": torch.tensor(self.replica_index),
                "number": self.replica_index,
                "rows": x[:, 0],
                "nothing": None,
            }

        def training_step_end(self, step_output: dict[str, Any]) -> torch.Tensor:
            gathered.append(step_output)
            return step_output["loss"].mean()

    data = regression_data()
    _fit(Indexed(), 5, devices=2, strategy="mgpu_dp", max_steps=1)
    output = gathered[0]
    assert torch.equal(output["index"], torch.tensor([0, 1]))
    assert output["index"].dtype == torch.int64
    assert torch.equal(output["number"], torch.tensor([0, 1]))
    assert output["loss"].shape == (2,)
    torch.testing.assert_close(output["rows"], data.tensors[0][:5, 0])
    assert output["nothing"] is None


def test_default_loss_is_weighted_by_chunk_size() -> None:
    losses: dict[str, torch.Tensor] = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
            losses[trainer.strategy.__class__.__name__] = outputs["loss"].detach()

    _fit(Regressor(), 5, max_steps=1, callbacks=[Capture()])
    _fit(Regressor(), 5, devices=2, strategy="mgpu_dp", max_steps=1, callbacks=[Capture()])
    assert losses["MGPUDPStrategy"].shape == ()
    torch.testing.assert_close(losses["MGPUDPStrategy"], losses["SingleDeviceStrategy"], atol=1e-6, rtol=0)
    x, y = regression_data().tensors
    with torch.no_grad():
        model = Regressor()
        chunk_losses = [torch.nn.functional.mse_loss(model(x[rows]), y[rows]) for rows in (slice(0, 3), slice(3, 5))]
    plain_mean = torch.stack(chunk_losses).mean()
    assert abs(plain_mean - losses["SingleDeviceStrategy"]) > 1e-3, "the uneven split must make a plain mean wrong"


def test_logging_from_replicas_and_step_end_matches_single_device() -> None:
    single = _fit(Regressor(), 5)
    parallel = _fit(Regressor(), 5, devices=2, strategy="mgpu_dp")
    torch.testing.assert_close(
        parallel.callback_metrics["train_loss"], single.callback_metrics["train_loss"], atol=1e-6, rtol=0
    )
    step_end = _fit(StepEndRegressor(), 5, devices=2, strategy="mgpu_dp", max_steps=2)
    assert step_end.callback_metrics["rows_seen"].item() == pytest.approx(10.0)


def test_log_reduce_fx_combines_across_replicas() -> None:
    class Logs(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("largest_index", float(self.replica_index), reduce_fx="max", on_step=True, on_epoch=False)
            self.log("rows", float(batch[0].shape[0]), reduce_fx="sum", on_step=True, on_epoch=False)
            self.log_dict({"index_mean": float(self.replica_index)}, on_step=True, on_epoch=False)
            return super().training_step(batch, batch_idx)

    fitted = _fit(Logs(), 5, devices=2, strategy="mgpu_dp", max_steps=1)
    metrics = fitted.callback_metrics
    assert metrics["largest_index"].item() == 1.0
    assert metrics["rows"].item() == 5.0
    assert metrics["index_mean"].item() == pytest.approx(2 / 5)


def test_validate_and_test_with_step_end_match_single_device() -> None:
    data = loader(regression_data(), 5)
    for name, run in [("val_loss", "validate"), ("test_loss", "test")]:
        expected = getattr(trainer(), run)(Regressor(), data, verbose=False)[0][name]
        parallel = trainer(devices=2, strategy="mgpu_dp")
        got = getattr(parallel, run)(StepEndRegressor(), data, verbose=False)[0][name]
        assert got == pytest.approx(expected, abs=1e-6)
        parallel = trainer(devices=2, strategy="mgpu_dp")
        default = getattr(parallel, run)(Regressor(), data, verbose=False)[0][name]
        assert default == pytest.approx(expected, abs=1e-6)


def test_predict_returns_every_row_in_order() -> None:
    model = Regressor()
    data = regression_data(rows=11)
    predictions = trainer(devices=3, strategy="mgpu_dp").predict(model, loader(data, 4))
    assert [prediction.shape[0] for prediction in predictions] == [4, 4, 3]
    with torch.no_grad():
        expected = model(data.tensors[0])
    torch.testing.assert_close(torch.cat(predictions), expected, atol=1e-6, rtol=0)


def test_predict_step_end_gets_the_gathered_rows() -> None:
    class Rounded(Regressor):
        def predict_step_end(self, predictions: torch.Tensor) -> dict[str, Any]:
            return {"rows": predictions.shape[0]}

    predictions = trainer(devices=2, strategy="mgpu_dp").predict(Rounded(), loader(regression_data(rows=7), 7))
    assert predictions == [{"rows": 7}]


def test_early_stopping_on_a_metric_logged_in_validation_step_end() -> None:
    class Worsening(StepEndRegressor):
        def validation_step_end(self, errors: torch.Tensor) -> None:
            self.log("val_loss", errors.mean() * 0 + float(self.current_epoch), prog_bar=True)

    stopper = EarlyStopping(monitor="val_loss", patience=1, mode="min")
    fitted = _fit(Worsening(), 5, val=True, devices=2, strategy="mgpu_dp", max_epochs=10, callbacks=[stopper])
    assert fitted.current_epoch == 2
    assert stopper.stopped_epoch == 1


def test_fit_with_validation_dataloader_logs_validation_from_step_end() -> None:
    model = StepEndRegressor()
    fitted = trainer(devices=2, strategy="mgpu_dp", max_epochs=1)
    fitted.fit(model, loader(regression_data(), 5), loader(regression_data(rows=7, seed=3), 3))
    single = trainer().validate(Regressor(), loader(regression_data(rows=7, seed=3), 3), verbose=False)
    assert "val_loss" in fitted.callback_metrics
    fresh = trainer(devices=2, strategy="mgpu_dp").validate(
        model, loader(regression_data(rows=7, seed=3), 3), verbose=False
    )
    assert fresh[0]["val_loss"] == pytest.approx(fitted.callback_metrics["val_loss"].item(), abs=1e-6)
    assert single[0]["val_loss"] != pytest.approx(fresh[0]["val_loss"], abs=1e-6), "fit must have changed the model"


def test_checkpoint_holds_plain_state_dict_and_resumes(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last", save_last=False)
    model = StepEndRegressor()
    fitted = _fit(model, 5, devices=2, strategy="mgpu_dp", enable_checkpointing=True, callbacks=[checkpoint])
    assert fitted.model is model, "the model is unwrapped after fit"
    path = tmp_path / "last.ckpt"
    saved = torch.load(path, weights_only=False)
    assert set(saved["state_dict"]) == set(model.state_dict())
    assert not any(key.startswith("module.") for key in saved["state_dict"])

    loaded = StepEndRegressor.load_from_checkpoint(path)
    assert_same_parameters(parameters(loaded), parameters(model))
    bare = Regressor()
    bare.load_state_dict(saved["state_dict"])
    assert_same_parameters(parameters(bare), parameters(model))

    resumed_dp = StepEndRegressor()
    _fit(resumed_dp, 5, devices=2, strategy="mgpu_dp", max_epochs=2, ckpt_path=str(path))
    resumed_single = Regressor()
    _fit(resumed_single, 5, max_epochs=2, ckpt_path=str(path))
    straight = Regressor()
    _fit(straight, 5, max_epochs=2)
    assert_same_parameters(parameters(resumed_dp), parameters(straight))
    assert_same_parameters(parameters(resumed_single), parameters(straight))


def test_estimated_stepping_batches_is_not_divided_by_devices() -> None:
    counts: list[int] = []

    class Count(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            counts.append(trainer.estimated_stepping_batches)

    _fit(Regressor(), 5, max_epochs=3, devices=2, strategy="mgpu_dp", callbacks=[Count()], limit_train_batches=2)
    _fit(Regressor(), 5, max_epochs=3, devices=1, callbacks=[Count()], limit_train_batches=2)
    assert counts == [6, 6]


def test_no_distributed_sampler_and_world_size_one() -> None:
    samplers: list[Any] = []

    class Inspect(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            sampler = trainer.train_dataloader.sampler
            samplers.append(type(getattr(sampler, "sampler", sampler)).__name__)  # inside ResumableSampler
            samplers.append(trainer.world_size)
            samplers.append(trainer.num_devices)

    _fit(Regressor(), 5, devices=2, strategy="mgpu_dp", max_steps=1, callbacks=[Inspect()])
    assert samplers == ["SequentialSampler", 1, 2]


def test_autocast_is_active_in_every_replica_thread() -> None:
    seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    class Mixed(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            output = self(batch[0])
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), output.dtype))
            return torch.nn.functional.mse_loss(output.float(), batch[1])

    _fit(Mixed(), 6, devices=3, strategy="mgpu_dp", max_steps=1, precision="bf16-mixed")
    assert seen == [(True, torch.bfloat16, torch.bfloat16)] * 3


def test_grad_mode_follows_the_loop_in_replicas() -> None:
    seen: dict[str, set[bool]] = {"train": set(), "val": set()}

    class Modes(StepEndRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen["train"].add(torch.is_grad_enabled())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            seen["val"].add(torch.is_grad_enabled())
            return super().validation_step(batch, batch_idx)

    model = Modes()
    fitted = trainer(devices=2, strategy="mgpu_dp", max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    fitted.fit(model, loader(regression_data(), 4), loader(regression_data(), 4))
    assert seen == {"train": {True}, "val": {False}}


def test_a_failing_replica_reraises_with_its_index_and_traceback() -> None:
    class Fails(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.replica_index == 1:
                raise ValueError("boom in the step")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="boom in the step") as caught:
        _fit(Fails(), 4, devices=2, strategy="mgpu_dp", max_steps=1)
    assert any("replica 1 of 2 on cpu" in note for note in caught.value.__notes__)
    frames = [entry.name for entry in caught.traceback]
    assert "training_step" in frames


def test_num_nodes_above_one_is_refused_early() -> None:
    with pytest.raises(lightning_mgpu.ConfigurationError, match=r"num_nodes=2.*mgpu_ddp") as caught:
        trainer(devices=2, strategy="mgpu_dp", num_nodes=2)
    assert caught.value.setting == "Trainer.num_nodes"


def test_batch_tensors_that_disagree_on_dim_0_are_refused() -> None:
    class Mismatched(Regressor):
        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            x, y = batch
            return x, y[:-1]

    with pytest.raises(lightning_mgpu.BatchSplitError) as caught:
        _fit(Mismatched(), 5, devices=2, strategy="mgpu_dp", max_steps=1)
    assert caught.value.path == "batch[1]"


def test_more_cuda_devices_than_the_machine_has_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(
        lightning_mgpu.ConfigurationError,
        match=r"mgpu_dp was asked for CUDA devices \[0, 1\], but this machine has 1 CUDA device\(s\), so \[1\] do not"
        r" exist\. Ask for at most devices=1, or use accelerator='cpu'",
    ) as caught:
        MGPUDPStrategy(parallel_devices=devices)
    assert caught.value.setting == "Trainer.devices"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(lightning_mgpu.ConfigurationError) as caught:
        MGPUDPStrategy(parallel_devices=devices)
    assert caught.value.setting == "Trainer.devices"


def test_the_lightning_device_attribute_shim_sets_the_replica_device() -> None:
    from lightning_mgpu.engine import replicate
    from lightning_mgpu.step.replicas import prepare_replica

    model = Regressor()
    replica = replicate(model, [torch.device("cpu")])[0]
    prepare_replica(replica, 0, 1, torch.device("meta"), 4)
    assert replica.device == torch.device("meta")
    assert model.device == torch.device("cpu")


def test_log_batch_size_from_replicas_weights_and_sums() -> None:
    class Weighted(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            rows = batch[0].shape[0]
            # Pretend replica 0 saw 1 real sample and replica 1 saw 3: the mean must follow those weights.
            self.log("weighted", float(self.replica_index), batch_size=1 + 2 * self.replica_index, on_epoch=True)
            self.log("plain", torch.tensor(float(rows)), on_epoch=True)
            return super().training_step(batch, batch_idx)

    metrics = _fit(Weighted(), 4, devices=2, strategy="mgpu_dp", max_steps=1).callback_metrics
    assert metrics["weighted"].item() == pytest.approx(3 / 4)
    assert metrics["weighted"].dtype == torch.float32
    assert metrics["plain"].item() == pytest.approx(2.0)


def test_manual_backward_inside_a_replica_is_refused_with_the_fix() -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.manual_backward(super().training_step(batch, batch_idx))

    with pytest.raises(RuntimeError, match=r"manual_backward\(\) was called inside a replica.*training_step_end"):
        _fit(Manual(), 4, devices=2, strategy="mgpu_dp", max_steps=1)


def test_manual_optimization_in_training_step_end_matches_single_device() -> None:
    class Manual(StepEndRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step_end(self, step_output: dict[str, torch.Tensor]) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(step_output["errors"].mean())
            optimizer.step()

    single = Regressor()
    _fit(single, 5, max_epochs=2)
    manual = Manual()
    _fit(manual, 5, max_epochs=2, devices=2, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(manual))


def test_the_wrapped_model_can_be_deep_copied() -> None:
    import copy

    fitted = trainer(devices=2, strategy="mgpu_dp", max_steps=1)
    model = Regressor()
    seen: list[Any] = []

    class CopyModel(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            seen.append(copy.deepcopy(trainer.model))

    fitted.callbacks.append(CopyModel())
    fitted.fit(model, loader(regression_data(), 4))
    copied = seen[0]
    torch.testing.assert_close(copied(torch.ones(3, 4)), model(torch.ones(3, 4)))
    copied.close()


class _Penalised(Regressor):
    """A weight penalty over a submodule's parameters, computed inside the step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert next(self.net.parameters()).device == self.device
        penalty = sum(p.pow(2).sum() for p in self.net[0].parameters()) + sum(
            p.abs().sum() for _, p in self.net.named_parameters()
        )
        self.log("penalty", penalty)
        return super().training_step(batch, batch_idx) + 0.01 * penalty


@pytest.mark.parametrize("devices", [2, 3])
def test_weight_penalty_over_a_submodule_inside_the_step_is_exact(devices: int) -> None:
    single, parallel = _Penalised(), _Penalised()
    single_trainer = _fit(single, 5, max_steps=3)
    parallel_trainer = _fit(parallel, 5, max_steps=3, devices=devices, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(parallel))
    torch.testing.assert_close(
        parallel_trainer.callback_metrics["penalty"], single_trainer.callback_metrics["penalty"], atol=1e-6, rtol=0
    )
    assert single_trainer.callback_metrics["penalty"] > 1.0


def test_stop_iteration_in_a_step_stops_training_with_an_error() -> None:
    class Exhausted(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            next(iter(nn.Identity().parameters()))
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match=r"StopIteration was raised inside replica 0 on cpu.*next\(\)"):
        _fit(Exhausted(), 4, devices=2, strategy="mgpu_dp", max_steps=1)


class _Counting(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps = self.steps + 1
        self.seen.add_(1)
        return super().training_step(batch, batch_idx)


def test_a_buffer_reassigned_in_the_step_is_kept_like_one_updated_in_place() -> None:
    single, parallel = _Counting(), _Counting()
    _fit(single, 5, max_steps=4)
    _fit(parallel, 5, max_steps=4, devices=3, strategy="mgpu_dp")
    assert single.steps.item() == parallel.steps.item() == 4.0
    assert single.seen.item() == parallel.seen.item() == 4.0
    assert_same_parameters(parameters(single), parameters(parallel))


class _Remembering(Regressor):
    """Assigns what Lightning's own tests and users' models assign in a step: inputs, flags, counters, the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.last_x = batch[0]  # one row per sample: the whole batch's, in batch order
        self.net[0].called = True  # the same in every replica: once
        self.steps_run += 1  # the same in every replica: once
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.detach()  # a mean over the rows: the rows' mean
        return loss


def test_attributes_assigned_in_the_step_are_one_devices() -> None:
    single = _Remembering()
    _fit(single, 5, max_steps=3)
    for devices in (2, 3):
        for _ in range(2):
            parallel = _Remembering()
            _fit(parallel, 5, devices=devices, strategy="mgpu_dp", max_steps=3)
            torch.testing.assert_close(parallel.last_x, single.last_x, atol=0, rtol=0)
            torch.testing.assert_close(parallel.last_loss, single.last_loss, atol=1e-6, rtol=0)
            assert parallel.net[0].called is True
            assert parallel.steps_run == single.steps_run == 3
            assert_same_parameters(parameters(parallel), parameters(single))


def test_an_attribute_assigned_by_a_replica_running_alone_reaches_the_module() -> None:
    """A batch of one row runs one replica, on a shell of the module like any other: what it assigns is kept."""
    single = _Remembering()
    _fit(single, 1, max_steps=3)
    parallel = _Remembering()
    _fit(parallel, 1, devices=2, strategy="mgpu_dp", max_steps=3)
    torch.testing.assert_close(parallel.last_loss, single.last_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(parallel.last_x, single.last_x, atol=0, rtol=0)
    assert parallel.steps_run == 3


def test_an_attribute_assigned_a_count_of_the_replicas_rows_stops_the_step_with_the_module_unchanged() -> None:
    class CountsRows(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.rows = len(batch[0])
            return super().training_step(batch, batch_idx)

    model = CountsRows()
    before = parameters(model)
    with pytest.raises(ReplicaStateError, match=r"assigned self\.rows inside the replicas.*differ \(3, 2\)") as caught:
        _fit(model, 5, devices=2, strategy="mgpu_dp", max_steps=1)
    assert (caught.value.path, caught.value.step) == ("self.rows", "training_step")
    assert not hasattr(model, "rows")
    assert_same_parameters(parameters(model), before, atol=0)


@pytest.mark.libraries
def test_caches_a_model_library_reassigns_in_its_own_forward_are_left_to_it() -> None:
    from collections import OrderedDict

    from torchvision.ops import MultiScaleRoIAlign

    class Pooled(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.pool = MultiScaleRoIAlign(["0"], output_size=1, sampling_ratio=1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            features = OrderedDict({"0": x.reshape(-1, 1, 2, 2)})
            boxes = [torch.tensor([[0.0, 0.0, 2.0, 2.0]])] * len(x)
            pooled = self.pool(features, boxes, [(2, 2)] * len(x)).reshape(len(x), 1)
            self.seen = len(x)
            return super().training_step((x * pooled, y), batch_idx)

    model = Pooled()
    pool_before = dict(vars(model.pool))
    _fit(model, 4, devices=2, strategy="mgpu_dp", max_steps=1)
    assert model.seen == 2  # each replica's 2 rows alike: taken once, as each DDP rank would hold it
    assert vars(model.pool).keys() == pool_before.keys()  # torchvision's scales and map_levels stay torchvision's
    assert all(vars(model.pool)[name] is value for name, value in pool_before.items() if not name.startswith("_"))


def _attribute_names(model: nn.Module) -> dict[str, list[str]]:
    return {name: sorted(vars(module)) for name, module in model.named_modules()}


@pytest.mark.parametrize("fails", [False, True], ids=["fit-succeeds", "fit-fails"])
def test_fit_leaves_the_module_with_the_attributes_one_device_leaves(fails: bool) -> None:
    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if fails and batch_idx == 1:
                raise ValueError("bad batch")
            return super().training_step(batch, batch_idx)

    names = []
    for strategy in ("auto", "mgpu_dp"):
        model = Failing()
        devices = 1 if strategy == "auto" else 2
        if fails:
            with pytest.raises(ValueError, match="bad batch"):
                _fit(model, 5, max_steps=2, devices=devices, strategy=strategy)
        else:
            _fit(model, 5, max_steps=2, devices=devices, strategy=strategy)
        names.append(_attribute_names(model))
        assert not hasattr(model, "replica_index")
        assert not hasattr(model, "num_replicas")
    assert names[0] == names[1]


class _TokenModel(Regressor):
    """A token-level cross-entropy over padded sequences: a mean over the real tokens, not over the rows."""

    def __init__(self, weighted: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7)
        self.weighted = weighted

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (tokens,) = batch
        logits = self.head(self.embed(tokens[:, :-1]))
        targets = tokens[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=0)
        self.log("token_loss", loss)
        if not self.weighted:
            return {"loss": loss}
        return {"loss": loss, "loss_weight": (targets != 0).sum()}


def _token_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 7, (10, 6), generator=generator)
    lengths = torch.tensor([6, 2, 5, 3, 6, 2, 4, 6, 3, 5])
    tokens[torch.arange(6) >= lengths[:, None]] = 0  # padding after each row's length
    return torch.utils.data.TensorDataset(tokens)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_loss_weight_makes_a_token_level_mean_exact(devices: int) -> None:
    def fit(model: L.LightningModule, **overrides: Any) -> L.Trainer:
        fitted = trainer(max_steps=2, **overrides)
        fitted.fit(model, loader(_token_data(), 5))
        return fitted

    single = _TokenModel(weighted=True)
    fit(single)
    weighted = _TokenModel(weighted=True)
    fit(weighted, devices=devices, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(weighted))
    by_rows = _TokenModel(weighted=False)
    fit(by_rows, devices=devices, strategy="mgpu_dp")
    drift = max((parameters(single)[name] - parameters(by_rows)[name]).abs().max() for name in parameters(single))
    assert drift > 1e-4, "weighting by rows should differ from the token mean on these uneven sequences"


def test_a_loss_weight_from_only_some_replicas_is_refused_naming_the_replica() -> None:
    class Partial(_TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            return output if self.replica_index == 0 else {"loss": output["loss"]}

    with pytest.raises(GatherError) as caught:
        trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(Partial(weighted=True), loader(_token_data(), 5))
    assert (caught.value.path, caught.value.replica) == ("output", 1)


def test_a_loss_weight_that_is_not_a_count_is_refused() -> None:
    class Listed(_TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            return {"loss": output["loss"], "loss_weight": output["loss_weight"].reshape(1).repeat(2)}

    with pytest.raises(ConfigurationError, match=r"'loss_weight' must be a number or a 0-dim tensor") as caught:
        trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(Listed(weighted=True), loader(_token_data(), 5))
    assert caught.value.setting == "LightningModule.training_step"


@pytest.mark.parametrize("devices", [2, 3])
def test_an_iterable_dataset_trains_as_on_one_device(devices: int) -> None:
    single = Regressor()
    trainer(max_epochs=2).fit(single, DataLoader(RegressionStream(), batch_size=4))
    split = Regressor()
    fitted = trainer(max_epochs=2, devices=devices, strategy="mgpu_dp")
    fitted.fit(split, DataLoader(RegressionStream(), batch_size=4))
    assert fitted.global_step == 10
    assert_same_parameters(parameters(single), parameters(split))


def _dict_backed_batch(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> DictBacked:
    x, y = default_collate(rows)
    return DictBacked({"x": x, "y": y})


class _DictBackedSteps(Regressor):
    """Takes a ``DictBacked`` batch and returns ``DictBacked`` outputs; keeps what ``training_step_end`` receives."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[type, dict[str, torch.Tensor]]] = []

    def training_step(self, batch: DictBacked, batch_idx: int) -> DictBacked:
        errors = (self(batch["x"]) - batch["y"]).pow(2).squeeze(1)
        return DictBacked({"errors": errors, "first_feature": batch["x"][:, 0]})

    def training_step_end(self, output: DictBacked) -> torch.Tensor:
        self.received.append((type(output), {key: value.detach().clone() for key, value in output.items()}))
        return output["errors"].mean()


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_a_mapping_of_its_own_reaches_training_step_end_with_its_type_and_values(devices: int) -> None:
    data = regression_data()
    x, y = data.tensors
    with torch.no_grad():
        first_errors = (Regressor()(x[:5]) - y[:5]).pow(2).squeeze(1)
    single = Regressor()
    trainer(max_epochs=2).fit(single, loader(data, 5))
    split = _DictBackedSteps()
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(
        split, DataLoader(data, batch_size=5, collate_fn=_dict_backed_batch)
    )
    assert [kind for kind, _ in split.received] == [DictBacked] * 8
    torch.testing.assert_close(split.received[0][1]["errors"], first_errors, atol=1e-6, rtol=0)
    torch.testing.assert_close(split.received[0][1]["first_feature"], x[:5, 0], atol=0, rtol=0)
    assert_same_parameters(parameters(single), parameters(split))


class _DictBackedLoss(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> DictBacked:
        return DictBacked({"loss": super().training_step(batch, batch_idx)})


@pytest.mark.parametrize("devices", [2, 3])
def test_a_mapping_of_its_own_holding_the_loss_reaches_lightning_without_training_step_end(devices: int) -> None:
    single = Regressor()
    trainer(max_epochs=2).fit(single, loader(regression_data(), 5))
    split = _DictBackedLoss()
    trainer(max_epochs=2, devices=devices, strategy="mgpu_dp").fit(split, loader(regression_data(), 5))
    assert_same_parameters(parameters(single), parameters(split))


def test_a_mapping_that_cannot_be_rebuilt_stops_the_step_with_a_gather_error() -> None:
    class KeywordsOnlySteps(StepEndRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> KeywordsOnly:
            x, y = batch
            errors = (self(x) - y).pow(2).squeeze(1)
            return KeywordsOnly(loss=errors.mean(), errors=errors)

        def training_step_end(self, output: KeywordsOnly) -> torch.Tensor:
            return output["errors"].mean()

    with pytest.raises(GatherError, match="KeywordsOnly") as caught:
        trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(KeywordsOnlySteps(), loader(regression_data(), 5))
    assert (caught.value.path, caught.value.replica) == ("output", None)


# --- keywords ---------------------------------------------------------------------------------------------------------

DP_KEYWORDS = [
    "accelerator",
    "parallel_devices",
    "checkpoint_io",
    "precision_plugin",
    "sync_batchnorm",
    "device_weights",
]


@pytest.mark.parametrize(
    "strategy_class", [MGPUDPStrategy, bound.MGPUDPStrategy], ids=["lightning", "pytorch_lightning"]
)
@pytest.mark.parametrize(
    ("misspelt", "meant"), [("sync_batchnrom", "sync_batchnorm"), ("device_weight", "device_weights")]
)
def test_a_misspelt_keyword_is_a_type_error_naming_the_keyword_meant(
    strategy_class: type[MGPUDPStrategy], misspelt: str, meant: str
) -> None:
    with pytest.raises(TypeError) as refused:
        strategy_class(**{misspelt: None})
    assert str(refused.value) == (
        f"MGPUDPStrategy() got an unexpected keyword argument {misspelt!r}. Did you mean {meant}?"
    )


def test_a_keyword_close_to_none_is_a_type_error_listing_every_keyword() -> None:
    with pytest.raises(TypeError) as refused:
        MGPUDPStrategy(replicas=2)  # type: ignore[call-arg]
    assert str(refused.value) == (
        "MGPUDPStrategy() got an unexpected keyword argument 'replicas'. The keywords it takes: accelerator,"
        " checkpoint_io, device_weights, parallel_devices, precision_plugin, sync_batchnorm."
    )


def test_the_keyword_check_leaves_the_signature_that_lightning_cli_reads() -> None:
    assert list(inspect.signature(MGPUDPStrategy).parameters) == DP_KEYWORDS
    assert list(inspect.signature(bound.MGPUDPStrategy).parameters) == DP_KEYWORDS
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(L.Trainer, "trainer")
    args = ["--trainer.strategy.class_path", "lightning_mgpu.MGPUDPStrategy"]
    config = parser.parse_args([*args, "--trainer.strategy.init_args.device_weights", "[1, 3]"])
    assert list(vars(config.trainer.strategy.init_args)) == DP_KEYWORDS
    assert config.trainer.strategy.init_args.device_weights == [1, 3]
    with pytest.raises(ArgumentError, match="sync_batchnrom"):
        parser.parse_args([*args, "--trainer.strategy.init_args.sync_batchnrom", "false"])
