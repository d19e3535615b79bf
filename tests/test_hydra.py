"""The trainer configs of ``configs/hydra/`` in a Hydra project written as lightning-hydra-template writes one.

``tests/hydra_project/`` is that project; each test copies it and drops the configs into its ``trainer/`` group as
they are, as docs/cli.md tells a project to. Composing and building the Trainer runs in this process; training runs
``train.py`` in a fresh interpreter, which never imports lightning_mgpu itself.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from processes import clean_env, free_port

from lightning_mgpu import MGPUDDPStrategy, MGPUDPStrategy
from lightning_mgpu.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "hydra_project"
CONFIGS = ROOT / "configs" / "hydra"
CLI_DOC = ROOT / "docs" / "cli.md"
STRATEGIES = {"mgpu_dp": MGPUDPStrategy, "mgpu_ddp": MGPUDDPStrategy, "mgpu_ddp_gather_step_end": MGPUDDPStrategy}
TIMEOUT = 240


def _copy_project(folder: Path) -> Path:
    project = folder / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("__pycache__"))
    for config in CONFIGS.glob("*.yaml"):
        shutil.copy(config, project / "configs" / "trainer")
    return project


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the project with the configs dropped into its ``trainer/`` group."""
    return _copy_project(tmp_path)


def _compose(project: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(project / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={project / 'out'}", *overrides])


def _hydra_section() -> str:
    return CLI_DOC.read_text().split("\n## Hydra\n", 1)[1].split("\n## ", 1)[0]


def _hydra_prose() -> str:
    """The section with its lines joined, so that a sentence wrapped over lines reads as one."""
    return " ".join(_hydra_section().split())


# --- composed and built in this process -------------------------------------------------------------------------------


def test_the_documented_configs_are_the_ones_there_are() -> None:
    listed = re.findall(r"^\| `(\w+)\.yaml` \|", _hydra_section(), flags=re.MULTILINE)
    assert sorted(listed) == sorted(path.stem for path in CONFIGS.glob("*.yaml")) == sorted(STRATEGIES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_config_builds_its_strategy_on_the_projects_defaults(project: Path, name: str) -> None:
    config = _compose(project, f"trainer={name}")
    default = OmegaConf.to_container(OmegaConf.load(project / "configs" / "trainer" / "default.yaml"))
    assert isinstance(default, dict)
    for key in ("min_epochs", "max_epochs", "check_val_every_n_epoch", "deterministic"):
        assert config.trainer[key] == default[key], key
    trainer = instantiate(config.trainer, logger=False)
    assert type(trainer.strategy) is STRATEGIES[name]
    assert (trainer.num_devices, trainer.max_epochs, trainer.default_root_dir) == (2, 3, str(project / "out"))
    assert trainer.strategy.root_device == torch.device("cpu")
    if name != "mgpu_dp":
        assert trainer.strategy.gather_step_end is name.endswith("gather_step_end")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_config_lists_the_strategys_own_defaults(name: str) -> None:
    listed: dict[str, Any] = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml").strategy)  # type: ignore[assignment]
    assert listed.pop("_target_") == f"lightning_mgpu.{STRATEGIES[name].__name__}"
    defaults = {key: inspect.signature(STRATEGIES[name]).parameters[key].default for key in listed}
    assert listed == defaults | ({"gather_step_end": True} if name.endswith("gather_step_end") else {})


def test_a_listed_keyword_is_overridden_as_it_is_and_another_with_a_plus(project: Path) -> None:
    overrides = [
        "trainer=mgpu_ddp",
        "trainer.strategy.find_unused_parameters=true",
        "+trainer.strategy.static_graph=true",
    ]
    trainer = instantiate(_compose(project, *overrides).trainer, logger=False)
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True
    assert trainer.strategy._ddp_kwargs["static_graph"] is True
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'trainer\.strategy\.uneven_batch'"):
        _compose(project, "trainer=mgpu_ddp", "trainer.strategy.uneven_batch=true")
    for claim in ("trainer.strategy.find_unused_parameters=true", "+trainer.strategy.static_graph=true"):
        assert f"(`{claim}`)" in _hydra_prose()
    assert "Could not override 'trainer.strategy.uneven_batch'" in _hydra_prose()


@pytest.mark.parametrize(
    ("name", "misspelt", "error", "message"),
    [
        ("mgpu_ddp", "uneven_batch=true", ConfigurationError, "Did you mean uneven_batches?"),
        (
            "mgpu_dp",
            "sync_batchnrom=false",
            TypeError,
            "MGPUDPStrategy() got an unexpected keyword argument 'sync_batchnrom'. Did you mean sync_batchnorm?",
        ),
    ],
)
def test_a_misspelt_keyword_names_the_keyword_meant(
    project: Path, name: str, misspelt: str, error: type[Exception], message: str
) -> None:
    config = _compose(project, f"trainer={name}", f"+trainer.strategy.{misspelt}")
    with pytest.raises(InstantiationException) as refused:
        instantiate(config.trainer, logger=False)
    assert type(refused.value.__cause__) is error
    assert message in str(refused.value.__cause__)
    assert message in str(refused.value)  # what Hydra prints
    assert f"+trainer.strategy.{misspelt}" in _hydra_prose()
    assert message in _hydra_prose()


def test_a_project_without_a_default_trainer_config_gets_hydras_message(project: Path) -> None:
    (project / "configs" / "trainer" / "default.yaml").unlink()
    with pytest.raises(MissingConfigException, match=r"Could not load 'trainer/default'"):
        _compose(project, "trainer=mgpu_dp")
    assert "Could not load 'trainer/default'" in _hydra_prose()


# --- trained by the project's train.py in a fresh interpreter ---------------------------------------------------------


def _train(project: Path, args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    folder = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
    return subprocess.run(
        [sys.executable, "train.py", *args, f"{folder}={out}"],
        cwd=project,
        env=clean_env(MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _result(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def _assert_same_parameters(result: dict[str, Any], one_device: dict[str, Any]) -> None:
    assert result["steps"] == one_device["steps"] == 24  # 3 epochs of 8 steps
    assert result["parameters"].keys() == one_device["parameters"].keys()
    for name, value in result["parameters"].items():
        torch.testing.assert_close(torch.tensor(value), torch.tensor(one_device["parameters"][name]), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_documented_commands_train_as_one_device(project: Path, tmp_path: Path) -> None:
    block = _hydra_section().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines()]
    assert all(command[:2] == ["python", "train.py"] for command in commands)
    results: dict[str, dict[str, Any]] = {}
    for index, command in enumerate(commands):
        out = tmp_path / f"run{index}"
        done = _train(project, command[2:], out)
        assert done.returncode == 0, done.stderr[-3000:]
        if "-m" in command:  # the multirun's jobs, numbered in the order of the sweep
            sweep = command[command.index("-m") + 1].removeprefix("trainer=").split(",")
            results |= {f"-m {job}": _result(out / str(number)) for number, job in enumerate(sweep)}
        else:
            results[shlex.join(command[2:])] = _result(out)
    assert list(results) == [
        "trainer=mgpu_dp",
        "trainer=mgpu_ddp trainer.strategy.uneven_batches=true",
        "trainer=mgpu_ddp_gather_step_end trainer.strategy.uneven_batches=true"
        " trainer.strategy.find_unused_parameters=true",
        "-m default",
        "-m mgpu_dp",
    ]
    one_device = results.pop("-m default")
    assert (one_device["strategy"], one_device["devices"]) == ("SingleDeviceStrategy", 1)
    for run, result in results.items():
        _assert_same_parameters(result, one_device)
        assert result["devices"] == 2, run
        ddp = "mgpu_ddp" in run
        assert (result["strategy"], result["world_size"]) == (("MGPUDDPStrategy", 2) if ddp else ("MGPUDPStrategy", 1))
        if ddp:
            assert result["uneven_batches"] is True
            gather = "gather_step_end" in run
            assert (result["gather_step_end"], result["find_unused_parameters"]) == (gather, gather), run


@pytest.mark.slow
def test_a_strategy_name_is_refused_where_train_py_does_not_import_the_package(project: Path, tmp_path: Path) -> None:
    done = _train(project, ["+trainer.strategy=mgpu_dp", "trainer.devices=2"], tmp_path / "out")
    assert done.returncode == 1
    assert "Error in call to target 'lightning.pytorch.trainer.trainer.Trainer'" in done.stderr
    assert "You selected an invalid strategy name: `strategy='mgpu_dp'`" in done.stderr
    for claim in ("Error in call to target 'lightning.pytorch.trainer.trainer.Trainer'", "invalid strategy name"):
        assert claim in _hydra_prose()


def test_the_projects_one_device_run_is_the_trainer_of_its_default_config(project: Path) -> None:
    trainer = instantiate(_compose(project).trainer, logger=False)
    assert isinstance(trainer, L.Trainer)
    assert trainer.num_devices == 1
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"


def test_lightning_restarts_a_ddp_job_with_its_whole_command_line_the_sweep_included(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why docs/cli.md runs each mgpu_ddp job without ``-m``: the further processes would run the whole sweep."""
    from hydra.core.hydra_config import HydraConfig
    from lightning.fabric.strategies.launchers.subprocess_script import _hydra_subprocess_cmd

    assert "Run each `mgpu_ddp` job on its own, without `-m`" in _hydra_prose()
    sweep = ["-m", "trainer=mgpu_ddp", "model.lr=0.1,0.2"]
    monkeypatch.setattr(sys, "argv", [str(project / "train.py"), *sweep])
    with initialize_config_dir(config_dir=str(project / "configs"), version_base="1.3"):
        config = compose("train", overrides=["trainer=mgpu_ddp"], return_hydra_config=True)
    HydraConfig.instance().set_config(config)
    try:
        command, _ = _hydra_subprocess_cmd(local_rank=1)
    finally:
        HydraConfig.instance().cfg = None
    assert command[-len(sweep) - 3 : -3] == sweep  # then Lightning's hydra.run.dir, hydra.job.name, hydra.output_subdir
    assert command[-3].startswith("hydra.run.dir=")
