"""Both Lightning namespaces, ``lightning.pytorch`` and ``pytorch_lightning``, with one ``import lightning_mgpu``.

Lightning installs the same trainer twice, with separate classes and strategy registries. Each Trainer here takes
every ``mgpu_`` name and an instance of either namespace's strategy class, which it turns into its own; ``mgpu_dp``
trains a ``pytorch_lightning`` module exactly as one device does; an instance crosses to the other Trainer in this
process and pickled into spawned ones; and a run that mixes the namespaces stops with the fix, where the package sees
it first.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from models import (
    PLPortable,
    PLRegressionData,
    PLRegressor,
    PLStepEndRegressor,
    RegressionData,
    Regressor,
    StepEndRegressor,
    assert_same_parameters,
    loader,
    parameters,
    pl_trainer,
    regression_data,
    trainer,
)
from processes import single_device_parameters

from lightning_mgpu import ConfigurationError, MGPUDDPStrategy, MGPUDPStrategy
from lightning_mgpu.cli import main
from lightning_mgpu.namespaces import LIGHTNING, Namespace, imported, namespace_of, pytorch_lightning_namespace
from lightning_mgpu.strategies import pytorch_lightning as bound
from lightning_mgpu.strategies.ddp import MGPUDDPLogic, lightning_ddp_names
from lightning_mgpu.strategies.dp import MGPUDPLogic

PYTORCH_LIGHTNING = pytorch_lightning_namespace()
assert PYTORCH_LIGHTNING is not None, "Lightning 2.x installs pytorch_lightning next to lightning.pytorch"
INSTALLED = imported()
TRAINERS = {"lightning.pytorch": L.Trainer, "pytorch_lightning": pl.Trainer}
BINDINGS = {  # each strategy class by namespace: the public ones, and pytorch_lightning's
    "lightning.pytorch": {"dp": MGPUDPStrategy, "ddp": MGPUDDPStrategy},
    "pytorch_lightning": {"dp": bound.MGPUDPStrategy, "ddp": bound.MGPUDDPStrategy},
}


def _mgpu_names(namespace: Namespace) -> list[str]:
    return [name for name in namespace.StrategyRegistry.available_strategies() if name.startswith("mgpu_")]


def _namespace_id(namespace: Namespace) -> str:
    return namespace.name


# --- names and instances ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", INSTALLED, ids=_namespace_id)
def test_each_registry_holds_every_name_bound_to_its_own_namespace(namespace: Namespace) -> None:
    registry = namespace.StrategyRegistry
    lightnings = [f"mgpu_{name}" for name in lightning_ddp_names(registry, namespace.DDPStrategy) if name != "ddp"]
    assert set(_mgpu_names(namespace)) == {"mgpu_dp", "mgpu_ddp", *lightnings}
    assert _mgpu_names(namespace) == _mgpu_names(LIGHTNING)
    for name in ["dp", *_mgpu_names(namespace)]:
        logic = MGPUDPLogic if name in ("dp", "mgpu_dp") else MGPUDDPLogic
        assert registry[name]["strategy"] is logic.bindings[namespace], name
        assert registry[name]["description"].startswith(logic.bindings[namespace].__name__)


@pytest.mark.parametrize(
    ("namespace", "name"),
    [(namespace, name) for namespace in INSTALLED for name in ["dp", *_mgpu_names(namespace)]],
    ids=lambda value: value.name if isinstance(value, Namespace) else value,
)
def test_every_name_builds_a_trainer_of_each_namespace(namespace: Namespace, name: str) -> None:
    built = TRAINERS[namespace.name](accelerator="cpu", devices=2, strategy=name, logger=False)
    kind = "dp" if name in ("dp", "mgpu_dp") else "ddp"
    assert type(built.strategy) is BINDINGS[namespace.name][kind]
    assert isinstance(built.strategy, BINDINGS["lightning.pytorch"][kind]), "isinstance of the public class holds"
    assert built.strategy.strategy_name == f"mgpu_{kind}"


@pytest.mark.parametrize("kind", ["dp", "ddp"])
@pytest.mark.parametrize("given", list(BINDINGS), ids=lambda name: f"{name}-instance")
@pytest.mark.parametrize("trainer_namespace", list(TRAINERS), ids=lambda name: f"{name}-trainer")
def test_an_instance_of_either_namespace_becomes_the_trainers_own(
    trainer_namespace: str, given: str, kind: str
) -> None:
    strategy = BINDINGS[given][kind]()
    built = TRAINERS[trainer_namespace](accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert built.strategy is strategy
    assert type(strategy) is BINDINGS[trainer_namespace][kind]
    assert isinstance(strategy, BINDINGS["lightning.pytorch"][kind])
    own = namespace_of(type(strategy))
    assert own is not None
    assert own.name == trainer_namespace
    left = {key: type(value) for key, value in vars(strategy).items() if namespace_of(type(value)) not in (None, own)}
    assert left == {}, "nothing of the other namespace stays on the strategy"


@pytest.mark.parametrize(
    ("base", "trainer_class", "binding"),
    [(MGPUDDPStrategy, pl.Trainer, bound.MGPUDDPStrategy), (bound.MGPUDDPStrategy, L.Trainer, MGPUDDPStrategy)],
    ids=["public-subclass-in-pytorch_lightning", "pytorch_lightning-subclass-in-lightning.pytorch"],
)
def test_a_subclass_given_to_the_other_namespaces_trainer_names_the_class_to_subclass(
    base: type, trainer_class: type, binding: type
) -> None:
    class Mine(base):  # type: ignore[misc,valid-type]
        pass

    with pytest.raises(ConfigurationError) as refused:
        trainer_class(accelerator="cpu", devices=2, strategy=Mine(), logger=False)
    assert refused.value.setting == "Trainer.strategy"
    message = str(refused.value)
    assert f"{Mine.__module__}.{Mine.__qualname__}" in message
    assert f"Subclass {binding.__module__}.{binding.__qualname__}" in message
    assert namespace_of(base).name in message  # type: ignore[union-attr]


# --- mgpu_dp on pytorch_lightning -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_class", "strategy"),
    [
        pytest.param(PLStepEndRegressor, "mgpu_dp", id="step-end-by-name"),
        pytest.param(PLStepEndRegressor, "dp", id="step-end-by-1.x-name"),
        pytest.param(PLRegressor, lambda: MGPUDPStrategy(sync_batchnorm=False), id="logged-in-replicas-instance"),
        pytest.param(PLStepEndRegressor, lambda: MGPUDPStrategy(device_weights=[1, 3]), id="uneven-device-weights"),
    ],
)
def test_mgpu_dp_trains_a_pytorch_lightning_module_as_one_device(model_class: type, strategy: Any) -> None:
    single = PLRegressor()
    pl_trainer(max_epochs=2).fit(single, loader(regression_data(), 4))
    model = model_class()
    run = pl_trainer(max_epochs=2, devices=2, strategy=strategy() if callable(strategy) else strategy)
    run.fit(model, loader(regression_data(), 4))

    assert isinstance(run.strategy, bound.MGPUDPStrategy)
    assert_same_parameters(parameters(single), parameters(model))
    assert float(run.callback_metrics["train_loss"]) == pytest.approx(
        float(single.trainer.callback_metrics["train_loss"])
    )
    if model_class is PLStepEndRegressor:
        assert float(run.callback_metrics["rows_seen_epoch"]) == 20, "training_step_end saw every row of each batch"


def test_an_mgpu_dp_instance_checkpoints_evaluates_and_predicts_in_pytorch_lightning(tmp_path: Path) -> None:
    model = PLStepEndRegressor()
    run = pl_trainer(tmp_path, max_epochs=1, devices=2, strategy=MGPUDPStrategy(), enable_checkpointing=True)
    run.fit(model, loader(regression_data(), 4), loader(regression_data(rows=5, seed=3), 2))
    checkpoint = Path(run.checkpoint_callback.best_model_path)  # type: ignore[union-attr]

    saved = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert saved.keys() == model.state_dict().keys(), "the module's own keys, no wrapper prefix"
    assert_same_parameters(parameters(PLStepEndRegressor.load_from_checkpoint(checkpoint)), parameters(model))
    reference = PLRegressor.load_from_checkpoint(checkpoint)  # the same weights, the loss in the step
    rows = loader(regression_data(rows=5, seed=3), 2)
    expected = pl_trainer().validate(reference, loader(regression_data(rows=5, seed=3), 5), verbose=False)[0]
    assert run.validate(model, rows, verbose=False)[0]["val_loss"] == pytest.approx(expected["val_loss"])
    assert run.test(model, rows, verbose=False)[0]["test_loss"] == pytest.approx(expected["val_loss"])
    predictions = run.predict(model, loader(regression_data(rows=7), 3))
    x = regression_data(rows=7).tensors[0]
    torch.testing.assert_close(torch.cat(predictions), model(x), atol=1e-6, rtol=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("strategy", "devices"), [(None, 1), ("mgpu_dp", 2)])
def test_mgpu_mixin_on_a_pytorch_lightning_module_equals_one_device(strategy: str | None, devices: int) -> None:
    model = PLPortable()
    overrides = {"strategy": strategy} if strategy else {}
    pl_trainer(max_epochs=2, devices=devices, **overrides).fit(model, loader(regression_data(), 4))
    assert_same_parameters(parameters(model), single_device_parameters())
    assert model.step_end_calls == 10, "training_step_end runs once per step"


def test_a_reduce_fx_lightning_rejects_raises_the_modules_own_exception_in_a_replica() -> None:
    class Median(PLRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("median", 1.0, reduce_fx="median")
            return super().training_step(batch, batch_idx)

    exceptions = {namespace.name: namespace.MisconfigurationException for namespace in INSTALLED}
    with pytest.raises(
        exceptions["pytorch_lightning"], match=r"(?s)reduce_fx=\{min,max,mean,sum\}.*in replica 0"
    ) as raised:
        pl_trainer(devices=2, strategy="mgpu_dp").fit(Median(), loader(regression_data(), 4))
    assert not isinstance(raised.value, exceptions["lightning.pytorch"])


# --- mgpu_ddp(uneven_batches=True) on pytorch_lightning, in one process -----------------------------------------------


def test_uneven_batches_refuses_an_accumulation_schedule_of_pytorch_lightning(tmp_path: Path) -> None:
    schedule = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
    run = pl_trainer(tmp_path, strategy=MGPUDDPStrategy(uneven_batches=True), max_epochs=2, callbacks=[schedule])
    with pytest.raises(ConfigurationError) as refused:
        run.fit(PLRegressor(), loader(regression_data(rows=10), 4))
    assert refused.value.setting == "Trainer.callbacks"


def test_uneven_batches_reads_the_dataloader_inside_a_pytorch_lightning_combined_loader(tmp_path: Path) -> None:
    combined = pl.utilities.CombinedLoader(loader(regression_data(rows=10), 2))
    run = pl_trainer(tmp_path, strategy=MGPUDDPStrategy(uneven_batches=True), max_epochs=1)
    run.fit(PLRegressor(), combined)
    assert run.global_step == 5


# --- mixing the namespaces --------------------------------------------------------------------------------------------


def test_a_lightning_pytorch_module_in_a_pytorch_lightning_trainer_is_lightnings_type_error() -> None:
    """What the README's troubleshooting row explains: Lightning refuses it before any strategy hook runs."""
    with pytest.raises(TypeError, match=r"`model` must be a `LightningModule`.*got `StepEndRegressor`"):
        pl_trainer(devices=2, strategy="mgpu_dp").fit(StepEndRegressor(), loader(regression_data(), 4))


@pytest.mark.parametrize(
    ("model_class", "data_class", "run"),
    [(PLRegressor, RegressionData, pl_trainer), (Regressor, PLRegressionData, trainer)],
    ids=["pytorch_lightning-model", "lightning.pytorch-model"],
)
def test_a_datamodule_of_the_other_namespace_stops_the_strategy_with_the_fix(
    model_class: type, data_class: type, run: Any
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        run(devices=2, strategy="mgpu_dp").fit(model_class(), datamodule=data_class())
    assert refused.value.setting == "Trainer.fit.datamodule"
    assert f"the datamodule {data_class.__name__} is {namespace_of(data_class).name}'s" in str(refused.value)  # type: ignore[union-attr]
    assert "`import pytorch_lightning as pl`" in str(refused.value)


def test_the_doctor_checks_a_pytorch_lightning_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", "models.PLStepEndRegressor", "--data", "models.PLRegressionData"]) == 0
    assert "PLStepEndRegressor" in capsys.readouterr().out


def test_the_doctor_refuses_classes_of_two_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", "models.PLStepEndRegressor", "--data", "models.RegressionData"]) == 2
    error = capsys.readouterr().err
    assert re.search(r"PLStepEndRegressor is pytorch_lightning's, but .* RegressionData is lightning\.pytorch's", error)
    assert "`import lightning.pytorch as pl` or `import pytorch_lightning as pl` everywhere" in error


# --- the command line -------------------------------------------------------------------------------------------------

_PL_RUN = ["--model", "models.PLStepEndRegressor", "--data", "models.PLRegressionData", "--trainer.accelerator", "cpu"]
_PL_RUN += ["--trainer.devices", "2", "--trainer.strategy", "mgpu_dp", "--trainer.max_epochs", "1"]


def test_the_command_line_runs_a_pytorch_lightning_model_with_its_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fit", *_PL_RUN, "--trainer.default_root_dir", str(tmp_path)]) == 0
    assert "lightning-mgpu fit: done in" in capsys.readouterr().out
    config = (tmp_path / "version_0" / "config.yaml").read_text()
    assert "# lightning-mgpu's default: pytorch_lightning.loggers.CSVLogger" in config, (
        "pytorch_lightning's Trainer ran"
    )
    checkpoint = next((tmp_path / "version_0" / "checkpoints").glob("*.ckpt"))
    assert (
        main(["validate", *_PL_RUN, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(checkpoint)]) == 0
    )
    assert re.search(r"final metrics: .*val_loss=\d", capsys.readouterr().out)


@pytest.mark.parametrize("given", ["flags", "config"])
def test_the_command_line_refuses_model_and_data_of_two_namespaces(
    given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "mixed.yaml"
    config.write_text("model:\n  class_path: models.StepEndRegressor\ndata: models.PLRegressionData\n")
    args = ["--config", str(config)] if given == "config" else ["--model", "models.StepEndRegressor"]
    args += ["--data", "models.PLRegressionData"] if given == "flags" else []
    assert main(["fit", *args, "--trainer.default_root_dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "lightning-mgpu fit: model models.StepEndRegressor is lightning.pytorch's, but data models.PLRegressionData"
        " is pytorch_lightning's: Lightning's two namespaces do not mix"
    )
    assert not (tmp_path / "version_0").exists()


# --- across processes -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("given", "run", "model_class", "becomes"),
    [
        (MGPUDDPStrategy, pl_trainer, PLRegressor, bound.MGPUDDPStrategy),
        (bound.MGPUDDPStrategy, trainer, Regressor, MGPUDDPStrategy),
    ],
    ids=["public-instance-in-pytorch_lightning", "pytorch_lightning-instance-in-lightning.pytorch"],
)
def test_an_instance_switched_to_the_other_namespace_is_pickled_into_spawned_processes(
    tmp_path: Path, given: type, run: Any, model_class: type, becomes: type
) -> None:
    model = model_class()
    before = parameters(model)
    spawned = run(tmp_path, devices=2, max_epochs=2, strategy=given(start_method="spawn"))
    spawned.fit(model, loader(regression_data(), 4))
    assert type(spawned.strategy) is becomes
    assert torch.isfinite(spawned.callback_metrics["train_loss"])
    after = parameters(model)  # the spawned rank 0's weights, brought back to this process
    assert not torch.equal(after["net.0.weight"], before["net.0.weight"])


@pytest.mark.slow
def test_without_pytorch_lightning_the_package_binds_to_lightning_pytorch_alone() -> None:
    code = (
        "import sys; sys.modules['pytorch_lightning'] = None;"  # as if it were not installed
        "import lightning as L, lightning_mgpu;"
        "from lightning_mgpu.namespaces import imported, pytorch_lightning_namespace;"
        "t = L.Trainer(accelerator='cpu', devices=2, strategy='mgpu_dp', logger=False);"
        "print([namespace.name for namespace in imported()], pytorch_lightning_namespace(), type(t.strategy).__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-3:] == ["['lightning.pytorch']", "None", "MGPUDPStrategy"]
