"""MGPUMixin: one LightningModule, unchanged, under every strategy; placement, unwrap, parameter registration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from models import Portable, Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from processes import free_port, rank_report, run_ddp_script, single_device_parameters
from torch import nn

import lightning_mgpu
from lightning_mgpu import MGPUDataParallel, MGPUMixin, register_parameters, to_device_of, unwrap


def _fit_in_process(strategy: str | None, devices: int, batch: int) -> Portable:
    model = Portable()
    overrides: dict[str, Any] = {"devices": devices}
    if strategy:
        overrides["strategy"] = strategy
    trainer(max_epochs=2, **overrides).fit(model, loader(regression_data(), batch))
    return model


@pytest.mark.parametrize(("strategy", "devices"), [(None, 1), ("mgpu_dp", 2), ("mgpu_dp", 1)])
def test_same_parameters_in_process(strategy: str | None, devices: int) -> None:
    model = _fit_in_process(strategy, devices, batch=4)
    assert_same_parameters(parameters(model), single_device_parameters())
    assert model.step_end_calls == 10, "training_step_end runs exactly once per step"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "mgpu_ddp"])
def test_same_parameters_under_ddp_in_two_processes(tmp_path: Path, strategy: str) -> None:
    result = run_ddp_script(tmp_path, "--model", "Portable", "--strategy", strategy, "--val-rows", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_parameters(torch.load(tmp_path / "params.pt"), single_device_parameters())
    metrics = rank_report(tmp_path, 0)["metrics"]
    assert "train_loss" in metrics, "training_step_end logged under this strategy"
    assert metrics["val_rows"] == (5.0 if strategy == "mgpu_ddp" else 6.0), "stock ddp pads validation shards"


def test_step_end_runs_once_when_a_subclass_calls_super() -> None:
    class Extended(Portable):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            output = super().training_step(batch, batch_idx)
            assert "errors" in output, "super() must hand back the raw step output"
            return output

    for overrides in ({}, {"devices": 2, "strategy": "mgpu_dp"}):
        model = Extended()
        trainer(max_steps=3, **overrides).fit(model, loader(regression_data(), 4))
        assert model.step_end_calls == 3


def test_a_step_that_returns_another_step_gets_its_raw_output() -> None:
    """``test_step`` returning ``self.validation_step(...)``, as 1.x projects write it: the test hook gets the raw
    output, and the validation hook does not run inside the test."""
    seen: list[tuple[str, Any]] = []

    class Tested(Portable):
        def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            x, y = batch
            return {"errors": self(x) - y}

        def validation_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
            seen.append(("validation_step_end", outputs))

        def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            return self.validation_step(batch, batch_idx)

        def test_step_end(self, outputs: dict[str, torch.Tensor]) -> None:
            seen.append(("test_step_end", outputs))
            self.log("test_mse", outputs["errors"].pow(2).mean())

    data = regression_data(rows=6, seed=3)
    for overrides in ({}, {"devices": 2, "strategy": "mgpu_dp"}):
        seen.clear()
        model = Tested()
        result = trainer(**overrides).test(model, loader(data, 6), verbose=False)
        assert [hook for hook, _ in seen] == ["test_step_end"], overrides
        assert seen[0][1]["errors"].shape == (6, 1)
        x, y = data.tensors
        with torch.no_grad():
            expected = (model(x) - y).pow(2).mean().item()
        assert result[0]["test_mse"] == pytest.approx(expected, abs=1e-6)


def test_lone_step_end_hook_runs_under_the_default_strategy() -> None:
    class Predicts(Portable):
        def predict_step_end(self, predictions: torch.Tensor) -> torch.Tensor:
            return predictions.squeeze(1).round(decimals=2)

    predictions = trainer().predict(Predicts(), loader(regression_data(rows=6), 3))
    assert [p.shape for p in predictions] == [torch.Size([3]), torch.Size([3])]


def test_validation_step_end_runs_under_the_default_strategy() -> None:
    result = trainer().validate(Portable(), loader(regression_data(rows=5, seed=3), 2), verbose=False)
    expected = trainer().validate(Regressor(), loader(regression_data(rows=5, seed=3), 5), verbose=False)
    assert result[0]["val_rows"] == 5.0
    assert result[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], abs=1e-6)


def test_overridden_checks_still_see_the_users_methods() -> None:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    class TrainOnly(MGPUMixin, L.LightningModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch.sum()

    assert is_overridden("training_step", TrainOnly())
    assert not is_overridden("validation_step", TrainOnly())


def test_replica_index_and_count_read_0_and_1_outside_dp() -> None:
    seen: list[tuple[int, int]] = []

    class Reads(Portable):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            seen.append((self.replica_index, self.num_replicas))
            return super().training_step(batch, batch_idx)

    trainer(max_steps=1).fit(Reads(), loader(regression_data(), 4))
    trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(Reads(), loader(regression_data(), 4))
    assert seen[0] == (0, 1)
    assert sorted(seen[1:]) == [(0, 2), (1, 2)]


def test_to_device_of_moves_nested_data_to_the_related_device() -> None:
    meta = torch.empty(1, device="meta")
    moved = to_device_of({"a": torch.ones(2), "b": [torch.zeros(1), 3]}, meta)
    assert moved["a"].device.type == "meta"
    assert moved["b"][0].device.type == "meta"
    assert moved["b"][1] == 3
    assert to_device_of(torch.ones(1), nn.Linear(1, 1).to("meta")).device.type == "meta"
    assert to_device_of(torch.ones(1), "meta").device.type == "meta"
    with pytest.raises(lightning_mgpu.ConfigurationError, match="holds no parameter.*to_device_of\\(obj, x\\)"):
        to_device_of(torch.ones(1), nn.ReLU())


def test_to_device_of_a_replica_uses_the_replica_device() -> None:
    devices: list[tuple[torch.device, torch.device, torch.device]] = []

    class Places(Portable):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            mask = self.to_device_of(torch.ones(batch[0].shape[0]), self)
            head = self.to_device_of(torch.ones(1), self.net[0])
            devices.append((mask.device, head.device, self.device))
            return super().training_step(batch, batch_idx)

    trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(Places(), loader(regression_data(), 4))
    assert devices == [(torch.device("cpu"),) * 3] * 2


def test_unwrap_finds_the_module_inside_every_wrapper() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap(inner) is inner
    assert unwrap(nn.DataParallel(inner)) is inner
    ours = MGPUDataParallel(inner, [torch.device("cpu")] * 2)
    assert unwrap(ours) is inner
    assert unwrap(torch.compile(ours)) is inner
    assert unwrap(nn.DataParallel(torch.compile(inner))) is inner
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert unwrap(nn.parallel.DistributedDataParallel(inner)) is inner
    finally:
        torch.distributed.destroy_process_group()
    ours.close()


def test_our_wrapper_passes_attributes_through_but_forwards_in_parallel() -> None:
    model = Portable()
    wrapped = MGPUDataParallel(model, [torch.device("cpu")] * 2)
    try:
        assert wrapped.lr == model.lr
        assert wrapped.net is model.net
        x = torch.randn(5, 4)
        torch.testing.assert_close(wrapped(x), model(x))
    finally:
        wrapped.close()


def test_register_parameters_follows_the_users_pattern() -> None:
    module = nn.Module()
    names = register_parameters(module, "H", [torch.ones(2, 3), nn.Parameter(torch.zeros(1))])
    assert names == ["H_0", "H_1"]
    assert [name for name, _ in module.named_parameters()] == ["H_0", "H_1"]
    assert isinstance(module.H_0, nn.Parameter)
    with pytest.raises(lightning_mgpu.ConfigurationError, match="has an attribute 'H_0'; choose another prefix"):
        register_parameters(module, "H", [torch.ones(1)])


class _Scaled(Portable):
    """Multiplies the errors by two scale parameters kept in the container under test."""

    def __init__(self, container: str) -> None:
        super().__init__()
        weights = [nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))]
        if container == "list":
            self.scales = weights
        elif container == "dict-of-modules":
            self.heads = {"a": nn.Linear(1, 1)}
        elif container == "parameter-list":
            self.scales = nn.ParameterList(weights)
        elif container == "parameter-dict":
            self.scale_dict = nn.ParameterDict({"a": weights[0], "b": weights[1]})
        elif container == "registered":
            register_parameters(self, "scale", weights)
        self.container = container

    def _scales(self) -> list[torch.Tensor]:
        if self.container == "parameter-dict":
            return [self.scale_dict["a"], self.scale_dict["b"]]
        if self.container == "registered":
            return [self.scale_0, self.scale_1]
        if self.container in ("list", "parameter-list"):
            return [self.scales[0], self.scales[1]]
        return [torch.ones(1), torch.ones(1)]

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        output = super().training_step(batch, batch_idx)
        first, second = self._scales()
        return {"errors": output["errors"] * first * second}


@pytest.mark.parametrize(("container", "where"), [("list", "scales"), ("dict-of-modules", "heads")])
@pytest.mark.parametrize("strategy", ["mgpu_dp", "mgpu_ddp"])
def test_parameters_and_modules_in_plain_containers_stop_fit(container: str, where: str, strategy: str) -> None:
    with pytest.raises(
        lightning_mgpu.ModelCheckError, match=rf"`{where}` is a plain Python .*(register_parameters|nn.ModuleList)"
    ):
        trainer(max_steps=1, devices=1, strategy=strategy).fit(_Scaled(container), loader(regression_data(), 4))


@pytest.mark.parametrize("container", ["parameter-list", "parameter-dict", "registered"])
def test_parameter_containers_replicate_and_train_under_dp(container: str) -> None:
    single = _Scaled(container)
    trainer(max_epochs=1).fit(single, loader(regression_data(), 4))
    parallel = _Scaled(container)
    trainer(max_epochs=1, devices=2, strategy="mgpu_dp").fit(parallel, loader(regression_data(), 4))
    assert_same_parameters(parameters(single), parameters(parallel))
    trained = [value for name, value in parameters(parallel).items() if "scale" in name]
    assert len(trained) == 2
    assert all(not torch.equal(value, torch.ones(1)) for value in trained), "the list's parameters were trained"


def test_unregistered_tensor_attributes_warn_with_the_fix() -> None:
    class Offset(Portable):
        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.zeros(1)

    with pytest.warns(UserWarning, match=r"`offset` is a tensor but neither a parameter nor a buffer.*register_buffer"):
        trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(Offset(), loader(regression_data(), 4))


def test_a_clean_model_passes_the_checks_silently(recwarn: pytest.WarningsRecorder) -> None:
    assert lightning_mgpu.check_model(Portable()) == []
    assert lightning_mgpu.check_model(_Scaled("parameter-list")) == []
    import torchmetrics

    with_metric = Portable()
    with_metric.metric = torchmetrics.MeanSquaredError()
    assert lightning_mgpu.check_model(with_metric) == []
