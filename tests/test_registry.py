"""Registration of the strategy names on import."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from models import Regressor, loader, regression_data, trainer

import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy, MGPUDPStrategy
from lightning_mgpu.cli import main


def test_import_registers_mgpu_dp() -> None:
    entry = StrategyRegistry["mgpu_dp"]
    assert entry["strategy"].__name__ == "MGPUDPStrategy"
    assert entry["description"] == "MGPUDPStrategy"


def test_importing_twice_and_reloading_is_harmless() -> None:
    importlib.reload(lightning_mgpu)
    importlib.reload(lightning_mgpu)
    lightning_mgpu.strategies.register_all()
    assert StrategyRegistry.available_strategies().count("mgpu_dp") == 1
    assert isinstance(
        L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp", logger=False).strategy, MGPUDPStrategy
    )


@pytest.mark.slow
def test_a_fresh_interpreter_gets_the_name_from_the_import_alone() -> None:
    code = (
        "import lightning as L, lightning_mgpu;"
        "t = L.Trainer(accelerator='cpu', devices=3, strategy='mgpu_dp', logger=False);"
        "print(type(t.strategy).__name__, t.num_devices, t.world_size)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-3:] == ["MGPUDPStrategy", "3", "1"]


@pytest.mark.parametrize("strategy", ["mgpu_dp", MGPUDPStrategy()])
def test_trainer_accepts_the_name_and_an_instance(strategy: object) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy, MGPUDPStrategy)
    assert trainer.strategy.root_device.type == "cpu"
    assert trainer.strategy.num_replicas == 2
    assert not trainer.strategy.is_distributed


# --- custom accelerators, whose devices may be anything -----------------------------------------------------------


class NamedDevices(Accelerator):
    """An accelerator of one's own whose devices are strings, as in Lightning's ``test_pluggable_accelerator``."""

    def setup_device(self, device: Any) -> None:
        pass

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        return devices

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[str]:
        return ["foo"] * devices

    @staticmethod
    def auto_device_count() -> int:
        return 3

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def name() -> str:
        return "mgpu_test_named_devices"


@pytest.fixture
def registered_accelerator() -> Iterator[str]:
    AcceleratorRegistry.register(NamedDevices.name(), NamedDevices)
    yield NamedDevices.name()
    AcceleratorRegistry.remove(NamedDevices.name())


@pytest.mark.parametrize("strategy", ["mgpu_dp", "mgpu_ddp"])
@pytest.mark.parametrize("given", ["instance", "registered name"])
def test_a_custom_accelerators_devices_reach_the_strategy_as_they_are(
    strategy: str, given: str, request: pytest.FixtureRequest
) -> None:
    accelerator = request.getfixturevalue("registered_accelerator") if given != "instance" else NamedDevices()
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.accelerator, NamedDevices)
    assert trainer.strategy.parallel_devices == ["foo", "foo"]


@pytest.mark.parametrize("strategy", [MGPUDPStrategy, MGPUDDPStrategy])
def test_a_strategy_built_on_a_custom_accelerator_takes_every_device_it_counts(strategy: type) -> None:
    trainer = L.Trainer(strategy=strategy(NamedDevices()), devices="auto", logger=False)
    assert isinstance(trainer.accelerator, NamedDevices)
    assert trainer.strategy.parallel_devices == ["foo"] * 3


class CPUDevices(NamedDevices):
    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:  # type: ignore[override]
        return [torch.device("cpu")] * devices


@pytest.mark.parametrize("strategy", ["mgpu_dp", "mgpu_ddp"])
def test_a_custom_accelerator_trains(strategy: str, tmp_path: Path) -> None:
    run = trainer(tmp_path, accelerator=CPUDevices(), strategy=strategy, max_steps=2)
    run.fit(Regressor(), loader(regression_data(), 4))
    assert isinstance(run.accelerator, CPUDevices)
    assert run.global_step == 2


# --- Lightning 1.x's name, and names that are nearly right ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def test_import_registers_lightning_1x_name_dp() -> None:
    entry = StrategyRegistry["dp"]
    assert entry["strategy"] is MGPUDPStrategy
    assert entry["description"] == "MGPUDPStrategy (mgpu_dp) under Lightning 1.x's name"
    lightning_mgpu.strategies.register_all()
    assert StrategyRegistry.available_strategies().count("dp") == 1
    assert StrategyRegistry["mgpu_dp"]["description"] == "MGPUDPStrategy"


@pytest.mark.parametrize("name", ["dp", "DP", "mgpu_DP"])
def test_trainer_takes_dp_and_any_letter_case(name: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert type(trainer.strategy) is MGPUDPStrategy
    assert trainer.strategy.strategy_name == "mgpu_dp"


def test_dp_owned_by_someone_else_is_left_alone() -> None:
    class TheirDataParallel:
        pass

    registry = type(StrategyRegistry)()
    registry.register("dp", TheirDataParallel, description="theirs")
    MGPUDPStrategy.register_strategies(registry)
    assert registry["dp"]["strategy"] is TheirDataParallel
    assert registry["mgpu_dp"]["strategy"] is MGPUDPStrategy


@pytest.mark.slow
def test_1x_code_runs_with_one_added_import_in_a_fresh_interpreter() -> None:
    code = (
        "import lightning as L, lightning_mgpu;"
        "t = L.Trainer(accelerator='cpu', devices=2, strategy='dp', logger=False);"
        "print(type(t.strategy).__name__, t.num_devices)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-2:] == ["MGPUDPStrategy", "2"]


@pytest.mark.parametrize(
    ("name", "meant"),
    [("mgpu-dp", ["mgpu_dp"]), ("MGPUDP", ["mgpu_dp"]), ("mgpu dp", ["mgpu_dp"]), ("mgpu-ddp", ["mgpu_ddp"])],
)
def test_close_names_forgive_case_dashes_and_dropped_underscores(name: str, meant: list[str]) -> None:
    assert lightning_mgpu.strategies.registry.close_names(name) == meant


def test_close_names_suggest_the_nearest_otherwise() -> None:
    assert lightning_mgpu.strategies.registry.close_names("fdsp")[0] == "fsdp"
    assert lightning_mgpu.strategies.registry.close_names("nothing like it") == []


@pytest.fixture
def _cli_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])  # pytest's own arguments are not the CLI's
    monkeypatch.chdir(ROOT)  # where the quickstart's examples.density resolves


@pytest.mark.usefixtures("_cli_argv")
@pytest.mark.parametrize(("name", "meant"), [("mgpu-dp", "mgpu_dp"), ("mgpudp", "mgpu_dp"), ("mgpu-ddp", "mgpu_ddp")])
def test_cli_names_the_strategy_meant_in_one_line(name: str, meant: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", "--config", str(QUICKSTART), "--trainer.strategy", name])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"lightning-mgpu fit: trainer.strategy '{name}' is not a registered strategy name.")
    assert f"Did you mean '{meant}'?" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.usefixtures("_cli_argv")
def test_cli_without_a_close_name_lists_what_there_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(QUICKSTART), "--trainer.strategy", "nothing like it"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean" not in err
    assert "lightning_mgpu registers mgpu_dp, mgpu_ddp and dp (Lightning 1.x's name for mgpu_dp)" in err


@pytest.mark.usefixtures("_cli_argv")
@pytest.mark.parametrize("name", ["dp", "mgpu_DP"])
def test_cli_runs_dp_and_any_letter_case(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--config", str(QUICKSTART), "--trainer.strategy", name, "--trainer.fast_dev_run", "1"]
    assert main([*args, "--trainer.default_root_dir", str(tmp_path)]) == 0
    assert "lightning-mgpu fit: done" in capsys.readouterr().out


# --- the strategy as a class-path string ------------------------------------------------------------------------------

FORMS_SCRIPT = ROOT / "tests" / "scripts" / "strategy_forms.py"


def test_each_binding_is_registered_under_its_class_paths_lowercased() -> None:
    assert MGPUDPStrategy.class_path_names() == (
        "lightning_mgpu.strategies.dp.mgpudpstrategy",
        "lightning_mgpu.mgpudpstrategy",
    )
    for name in MGPUDPStrategy.class_path_names() + MGPUDDPStrategy.class_path_names():
        entry = StrategyRegistry[name]
        assert entry["strategy"] is (MGPUDPStrategy if "mgpudp" in name else MGPUDDPStrategy)
        assert entry["init_params"] == {}


@pytest.mark.parametrize("path", ["lightning_mgpu.MGPUDPStrategy", "lightning_mgpu.strategies.dp.MGPUDPStrategy"])
def test_trainer_takes_the_class_path_as_a_string(path: str) -> None:
    built = L.Trainer(accelerator="cpu", devices=2, strategy=path, logger=False)
    assert type(built.strategy) is MGPUDPStrategy
    assert built.strategy.num_replicas == 2


def test_a_subclass_registers_its_own_class_path_only() -> None:
    class Mine(MGPUDPStrategy):
        strategy_name = "mine"

    registry = type(StrategyRegistry)()
    Mine.register_strategies(registry)
    assert set(registry.available_strategies()) == {"mine", f"{__name__}.{Mine.__qualname__}".lower(), "dp"}


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_every_documented_form_of_the_strategy_works_in_a_script_of_ones_own(namespace: str) -> None:
    result = subprocess.run(
        [sys.executable, str(FORMS_SCRIPT), namespace], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("FORM ")]
    forms = {line.pop("form"): line for line in lines}
    module = "lightning_mgpu.strategies." + ("pytorch_lightning" if namespace == "pytorch_lightning" else "{kind}")
    dp, ddp = module.format(kind="dp") + ".MGPUDPStrategy", module.format(kind="ddp") + ".MGPUDDPStrategy"

    refused = [form for form in forms if form.startswith("before import: ") and "class_path" not in form]
    assert len(refused) == 4
    for form in refused:  # a name or a class-path string means nothing to Lightning until the package is imported
        assert forms[form]["error"].startswith("ValueError: You selected an invalid strategy name"), form
    assert forms["before import: cli YAML class_path"] == {
        "imported": False,
        "class": dp,
        "sync_batchnorm": False,
        "gather_step_end": None,
        "find_unused_parameters": None,
        "steps": 1,
    }
    for name in ("mgpu_dp", "lightning_mgpu.MGPUDPStrategy"):
        for form in (f"cli --trainer.strategy {name}", f"Trainer(strategy={name!r})"):
            assert forms[form] == {
                "imported": True,
                "class": dp,
                "sync_batchnorm": True,
                "gather_step_end": None,
                "find_unused_parameters": None,
                "steps": 1,
            }, form
    for name in ("mgpu_ddp", "lightning_mgpu.MGPUDDPStrategy"):
        for form in (f"cli --trainer.strategy {name}", f"Trainer(strategy={name!r})"):
            assert forms[form]["class"] == ddp, form
            assert (forms[form]["gather_step_end"], forms[form]["find_unused_parameters"]) == (False, False), form
    with_init_args = forms["cli --trainer.strategy.class_path lightning_mgpu.MGPUDDPStrategy with init_args"]
    assert (with_init_args["class"], with_init_args["gather_step_end"], with_init_args["find_unused_parameters"]) == (
        ddp,
        True,
        True,
    )
    assert (forms["cli YAML class_path"]["class"], forms["cli YAML class_path"]["sync_batchnorm"]) == (dp, False)
    assert forms["Trainer(strategy=MGPUDPStrategy(...))"]["class"] == dp
    assert forms["Trainer(strategy=MGPUDPStrategy(...))"]["steps"] == 1
    assert (
        forms["Trainer(strategy=MGPUDDPStrategy(...))"]["class"],
        forms["Trainer(strategy=MGPUDDPStrategy(...))"]["gather_step_end"],
    ) == (ddp, True)
    assert [form for form, line in forms.items() if "error" in line] == refused
