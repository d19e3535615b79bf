"""``lightning-mgpu fit|validate|test|predict``, ``python examples/*.py`` and the README's snippet, driven as a user.

Every file in ``configs/`` runs here. ``mgpu_dp`` runs go through ``lightning_mgpu.cli.main`` in this process; every
run that starts its own processes (``mgpu_ddp`` with 2 devices re-runs the command line, the example scripts, the
README, the legacy launcher) or whose output must be seen as a terminal shows it (stdout and stderr interleaved) is
a real subprocess. Those are started together by the ``launches`` fixture when the first test that waits for one
begins (only the ones the selected tests need, as ``tests/conftest.py`` records), so they run alongside the
in-process tests after it, and each test then waits for its own, with a timeout.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from processes import SELECTED_LAUNCHES, clean_env, free_ports, start_in_session, stop_session
from run_folders import column, read_metrics

import lightning_mgpu
from lightning_mgpu.cli import main
from lightning_mgpu.cli.lightning_cli import MGPULightningCLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples.density, as the CLI resolves it from the repository root

LAUNCH_TIMEOUT = 240
# One epoch of 2000 samples in batches of 250 per process: 4 steps on each of 2 ranks (one process would take 8).
SMALL_DENSITY = ["--trainer.max_epochs", "1"]
SMALL_DENSITY += ["--data.init_args.num_samples", "2000", "--data.init_args.num_val_samples", "500"]


@dataclass(frozen=True)
class Summary:
    """The closing summary of a ``lightning-mgpu`` command, parsed."""

    subcommand: str
    steps: int | None  # fit
    checkpoint_used: Path | None  # validate, test, predict with --ckpt_path
    metrics: dict[str, float]
    files: dict[str, Path]


def readable(output: str, limit: int = 4000) -> str:
    """The end of a command's output without its progress bars, for failure messages."""
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    return "\n".join(lines)[-limit:]


def parse_summary(output: str) -> Summary:
    start = output.rfind("lightning-mgpu ")
    match = re.match(r"lightning-mgpu (\w+): done in [\d.]+ s \((.+)\)$", output[start:], flags=re.MULTILINE)
    assert match, f"no closing summary in the output:\n{readable(output)}"
    what = match.group(2)
    steps = re.fullmatch(r"(\d+) training steps", what)
    checkpoint = re.fullmatch(r"checkpoint (.+)", what)
    metrics: dict[str, float] = {}
    files: dict[str, Path] = {}
    for line in output[start:].splitlines()[1:]:
        entry = re.match(r"  ([\w. ]+):\s+(.+)$", line)
        if not entry:
            break
        key, value = entry.groups()
        if key == "final metrics":
            metrics = {name: float(number) for name, number in re.findall(r"(\w+)=([-+\w.]+)", value)}
        else:
            files[key] = Path(value)
    return Summary(
        match.group(1),
        int(steps.group(1)) if steps else None,
        Path(checkpoint.group(1)) if checkpoint else None,
        metrics,
        files,
    )


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])  # pytest's own arguments are not the CLI's


# Commands that start their own processes, by name: the arguments after `python`, and whether they run in the
# repository root (as `lightning-mgpu` is documented to) or elsewhere (as the example scripts may).
LAUNCHES: dict[str, tuple[list[str], str]] = {
    # strategy: mgpu_ddp as a string in YAML
    "ddp_cpu.yaml": (["-m", "lightning_mgpu", "fit", "--config", "configs/ddp_cpu.yaml", *SMALL_DENSITY], "root"),
    # strategy: {class_path: lightning_mgpu.MGPUDDPStrategy, init_args: {...}} in YAML, the GPU config moved to the CPU,
    # with a keyword of DDP's own, which the parser finds by following the strategy's **kwargs into DDP
    "ddp_gpu.yaml": (
        ["-m", "lightning_mgpu", "fit", "--config", "configs/ddp_gpu.yaml", "--trainer.accelerator", "cpu"]
        + ["--trainer.strategy.init_args.bucket_cap_mb", "25", *SMALL_DENSITY],
        "root",
    ),
    # the density script with the quickstart (mgpu_dp in YAML) switched to mgpu_ddp by name on the command line
    "examples/density.py --trainer.strategy mgpu_ddp": (
        [str(ROOT / "examples" / "density.py"), "fit", "--config", str(QUICKSTART)]
        + ["--trainer.strategy", "mgpu_ddp", "--trainer.devices", "2", *SMALL_DENSITY],
        "elsewhere",
    ),
    # the classifier script switched to mgpu_ddp by class path on the command line
    "examples/classifier.py --trainer.strategy lightning_mgpu.MGPUDDPStrategy": (
        [str(ROOT / "examples" / "classifier.py"), "fit", "--config", str(CONFIGS / "classifier.yaml")]
        + [
            "--trainer.strategy",
            "lightning_mgpu.MGPUDDPStrategy",
            "--trainer.devices",
            "2",
            "--trainer.max_epochs",
            "1",
        ],
        "elsewhere",
    ),
    "README usage": (["readme_usage.py"], "elsewhere"),
    # docs/ddp.md's uneven_batches command, which tests/test_docs.py runs as written; here its steps and files are
    # checked: 4 full steps of 2 x 250 rows, then one of a single row
    "docs/ddp.md uneven_batches": (
        ["-m", "lightning_mgpu", "fit", "--config", "configs/ddp_cpu.yaml"]
        + ["--trainer.strategy.class_path", "lightning_mgpu.MGPUDDPStrategy"]
        + ["--trainer.strategy.init_args.uneven_batches", "true", *SMALL_DENSITY, "--data.num_samples", "2001"],
        "root",
    ),
    # the legacy launcher puts --local-rank=N before the command's own arguments
    "torch.distributed.launch": (
        ["-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", "{port}"]
        + ["-m", "lightning_mgpu", "fit", "--config", "configs/ddp_cpu.yaml", *SMALL_DENSITY],
        "root",
    ),
    # 2001 samples in batches of 500: the last batch has 1 row for 2 replicas, under a real progress bar
    "idle devices": (
        ["-m", "lightning_mgpu", "fit", "--config", "configs/quickstart.yaml", "--trainer.max_epochs", "1"]
        + ["--data.init_args.num_samples", "2001", "--data.init_args.num_val_samples", "500"],
        "root",
    ),
}
DDP_STEPS = {
    "ddp_cpu.yaml": 4,
    "ddp_gpu.yaml": 4,
    "examples/density.py --trainer.strategy mgpu_ddp": 2,  # 1000 samples per rank in batches of 500
    # 719 images per rank, batches of 64
    "examples/classifier.py --trainer.strategy lightning_mgpu.MGPUDDPStrategy": 12,
    "docs/ddp.md uneven_batches": 5,
}


@dataclass
class Launch:
    """One command started in the background, its output going to a file."""

    process: subprocess.Popen[bytes]
    log: Path
    root: Path
    deadline: float

    def result(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"timed out after {LAUNCH_TIMEOUT} s:\n{readable(self.log.read_text())}")
        return code, self.log.read_text()

    def stop(self) -> None:
        stop_session(self.process)


def _readme_usage() -> str:
    """The README's ```python block with ``Trainer(strategy="mgpu_dp"``, found by content, not by position."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    usage = [block for block in blocks if 'Trainer(strategy="mgpu_dp"' in block]
    assert usage, 'README.md has no ```python block with Trainer(strategy="mgpu_dp"'
    return usage[0]


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launch]]:
    """Every launch that a selected test waits for, all started at once when the first of those tests begins.

    Which ones: the ``launch`` parameters of the selected tests that request this fixture, recorded by
    ``tests/conftest.py`` once collection is over.
    """
    selected = request.config.stash.get(SELECTED_LAUNCHES, set(LAUNCHES))
    started: dict[str, Launch] = {}
    for (name, (args, where)), port in zip(LAUNCHES.items(), free_ports(len(LAUNCHES)), strict=True):
        if name not in selected:
            continue
        folder = tmp_path_factory.mktemp("launch")
        root, cwd = folder / "runs", folder / "elsewhere"
        cwd.mkdir()
        if name == "README usage":
            (cwd / "readme_usage.py").write_text(
                _readme_usage()
                + "\nprint('strategy', type(trainer.strategy).__name__, 'devices', trainer.num_devices)"
                + "\nprint('global_step', trainer.global_step)"
                + "\nprint('train_mse', float(trainer.callback_metrics['train_mse']))\n"
            )
        else:
            args = [arg.replace("{port}", str(port)) for arg in args] + ["--trainer.default_root_dir", str(root)]
        log = folder / "output.log"
        env = clean_env(MASTER_PORT=str(port))
        process = start_in_session([sys.executable, *args], ROOT if where == "root" else cwd, env, log)
        started[name] = Launch(process, log, root, time.monotonic() + LAUNCH_TIMEOUT)
    yield started
    for launch in started.values():
        launch.stop()


# The mgpu_dp configs, run in this process: the file, its overrides, the metric to read back.
MGPU_DP_CONFIGS = [
    ("quickstart.yaml", [], "val_nll"),
    ("classifier.yaml", [], "val_acc"),
    ("dp_gpu.yaml", ["--trainer.accelerator", "cpu", "--trainer.devices", "2"], "val_nll"),  # bf16-mixed on the CPU
]


def test_every_config_is_run_here() -> None:
    in_process = {config for config, _, _ in MGPU_DP_CONFIGS}
    launched = {name for name in DDP_STEPS if name.endswith(".yaml")}
    assert {path.name for path in CONFIGS.glob("*.yaml")} == in_process | launched


@pytest.mark.parametrize(("config", "overrides", "metric"), MGPU_DP_CONFIGS)
def test_mgpu_dp_configs_run(
    config: str, overrides: list[str], metric: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = MGPULightningCLI(
        args=["fit", "--config", str(CONFIGS / config), *overrides, "--trainer.fast_dev_run", "2"]
        + ["--trainer.default_root_dir", str(tmp_path)]
    )
    summary = parse_summary(capsys.readouterr().out)

    assert isinstance(cli.trainer.strategy, lightning_mgpu.MGPUDPStrategy)
    assert cli.trainer.num_devices == 2
    assert summary.steps == cli.trainer.global_step == 2
    assert math.isfinite(summary.metrics[metric])
    assert summary.metrics[metric] == pytest.approx(cli.trainer.callback_metrics[metric].item(), rel=1e-3)


def test_dp_gpu_config_asks_for_every_gpu_in_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(CONFIGS / "dp_gpu.yaml"), "--print_config"])
    assert exit_.value.code in (0, None)
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["strategy"]) == ("gpu", -1, "mgpu_dp")
    assert trainer["precision"] == "bf16-mixed"


def test_ddp_gpu_config_gives_the_strategy_by_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIGS / "ddp_gpu.yaml"), "--print_config"])
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert (trainer["accelerator"], trainer["devices"]) == ("gpu", 2)
    assert trainer["strategy"]["class_path"] == "lightning_mgpu.MGPUDDPStrategy"
    assert trainer["strategy"]["init_args"]["find_unused_parameters"] is False
    assert trainer["strategy"]["init_args"]["broadcast_buffers"] is False


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(DDP_STEPS))
def test_mgpu_ddp_runs_two_processes(launch: str, launches: dict[str, Launch]) -> None:
    code, output = launches[launch].result()

    assert code == 0, readable(output)
    assert "Starting with 2 processes" in output
    summary = parse_summary(output)
    # Each rank loads its half of the training samples: half the steps of one process.
    assert summary.steps == DDP_STEPS[launch]
    assert summary.files["run folder"].parent == launches[launch].root
    assert summary.files["checkpoint"].name == f"epoch=0-step={DDP_STEPS[launch]}.ckpt"
    assert summary.files["checkpoint"].is_file()
    metric = "val_acc" if "classifier" in launch else "val_nll"
    assert column(read_metrics(summary.files["run folder"]), metric) == [pytest.approx(summary.metrics[metric], 1e-3)]
    if "density" in launch:
        assert 4 < summary.metrics["val_nll"] < 10
        assert (summary.files["run folder"] / "density.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # rank 0's
    if "classifier" in launch:
        assert 0.5 < summary.metrics["val_acc"] <= 1  # one epoch: ~0.8


def test_strategy_by_name_or_class_path_trains_alike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class_path_config = tmp_path / "class_path.yaml"
    class_path_config.write_text("trainer:\n  strategy:\n    class_path: lightning_mgpu.MGPUDPStrategy\n")
    init_args = ["--trainer.strategy.class_path", "lightning_mgpu.MGPUDPStrategy"]
    init_args += ["--trainer.strategy.init_args.sync_batchnorm", "true"]
    ways = {
        "name in YAML": [],
        "class_path in YAML": ["--config", str(class_path_config)],
        "class path on the command line": ["--trainer.strategy", "lightning_mgpu.MGPUDPStrategy"],
        "class_path and init_args on the command line": init_args,
    }
    results = {}
    for way, args in ways.items():
        cli = MGPULightningCLI(
            args=["fit", "--config", str(QUICKSTART), *args, "--trainer.max_steps", "3"]
            + ["--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]
            + ["--trainer.default_root_dir", str(tmp_path / way.replace(" ", "_"))]
        )
        assert type(cli.trainer.strategy) is lightning_mgpu.MGPUDPStrategy, way
        assert cli.trainer.num_devices == 2
        results[way] = (cli.trainer.callback_metrics["val_nll"].item(), cli.model.state_dict())
    capsys.readouterr()

    (val_nll, params), *others = results.values()
    assert 4 < val_nll < 10  # bits per sample after 3 steps (the mixture's entropy is ~4.78)
    for other_nll, other_params in others:
        assert other_nll == pytest.approx(val_nll, abs=1e-6)
        for name, value in params.items():
            torch.testing.assert_close(other_params[name], value, rtol=0, atol=1e-7)


def test_a_strategy_class_path_that_does_not_import_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(QUICKSTART), "--trainer.strategy", "lightning_mgpu.NoSuchStrategy"]) == 2
    assert re.fullmatch(
        r"lightning-mgpu fit: trainer.strategy 'lightning_mgpu\.NoSuchStrategy' is neither a registered strategy"
        r" name nor an importable class .*lightning_mgpu\.MGPUDDPStrategy\.\n",
        capsys.readouterr().err,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_a_gpu_config_without_gpus_ends_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(CONFIGS / "dp_gpu.yaml"), "--trainer.default_root_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "lightning-mgpu fit: trainer.accelerator 'gpu' with trainer.devices -1 asks for every GPU (at least 1), but"
        " this machine has 0 CUDA device(s). Run on the CPU with --trainer.accelerator cpu (with --trainer.devices 2"
        " for 2 virtual replicas or processes), or use a CPU config such as configs/quickstart.yaml.\n"
    )
    assert not list(tmp_path.iterdir())


def test_more_gpus_than_the_machine_has_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = ["fit", "--config", str(CONFIGS / "ddp_gpu.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    assert main([*args, "--trainer.devices", "[0, 1]"]) == 2
    assert re.fullmatch(
        r"lightning-mgpu fit: trainer.accelerator 'gpu' with trainer.devices \[0, 1\] asks for 2 GPU\(s\), with"
        r" indices \[0, 1\], but this machine has 1 CUDA device\(s\)\. Run on the CPU with --trainer.accelerator"
        r" cpu .* configs/quickstart\.yaml\. Or ask for at most --trainer\.devices 1\.\n",
        capsys.readouterr().err,
    )


def test_a_class_path_that_does_not_import_outside_the_repository_root_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # where `examples` is not, as for a user who left the repository root
    monkeypatch.setattr(sys, "path", [path for path in sys.path if Path(path or ".").resolve() != ROOT])
    for name in [name for name in sys.modules if name == "examples" or name.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)

    assert main(["fit", "--config", str(QUICKSTART)]) == 2

    assert capsys.readouterr().err == (
        "lightning-mgpu fit: model: class path 'examples.density.DensityModel' does not import: there is no package"
        f" 'examples' in the current directory ({tmp_path}) or on PYTHONPATH. Run the command from the folder that"
        " holds examples/ (the repository root), or put that folder on PYTHONPATH."
        f" Here that is {ROOT}: cd {ROOT}, or PYTHONPATH={ROOT}.\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_class_is_named_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(QUICKSTART), "--model.class_path", "examples.density.DensityModle"]) == 2
    assert capsys.readouterr().err == (
        "lightning-mgpu fit: model: class path 'examples.density.DensityModle' does not import: module"
        " examples.density has no 'DensityModle'; check the name.\n"
    )


_MISSPELT_TRAINER_KEY = "'trainer.max_epoch' is not a setting of this command. Did you mean trainer.max_epochs?"
_MISSPELT_STRATEGY_ARGUMENT = (
    "strategy: {class_path: lightning_mgpu.MGPUDDPStrategy, init_args: {find_unused_parameter: true}}"
)
_ONE_DEVICE_ONE_BATCH = ["--trainer.devices", "1", "--trainer.fast_dev_run", "1"]  # in this process, should it run


@pytest.mark.parametrize(
    ("config_edit", "overrides", "line"),
    [
        pytest.param(("max_epochs:", "max_epoch:"), [], _MISSPELT_TRAINER_KEY, id="key misspelt in the config"),
        pytest.param(
            None,
            ["--trainr.max_epochs", "3"],
            "'trainr.max_epochs' is not a setting of this command. Did you mean trainer.max_epochs?",
            id="key misspelt on the command line",
        ),
        pytest.param(
            ("    batch_size:", "    bach_size:"),
            [],
            "data.init_args.bach_size is not an argument of examples.density.GaussianMixtureData. Did you mean"
            " data.init_args.batch_size?",
            id="init argument misspelt in the config",
        ),
        pytest.param(
            None,
            ["--model.init_args.bach_size", "3"],
            "model.init_args.bach_size is not an argument of examples.density.DensityModel. Check the name; it takes"
            " channels, hidden_filters, init_scale, lr.",
            id="init argument the class does not take",
        ),
        pytest.param(
            ("strategy: mgpu_dp", _MISSPELT_STRATEGY_ARGUMENT),
            _ONE_DEVICE_ONE_BATCH,
            "trainer.strategy.init_args.find_unused_parameter is not an argument of lightning_mgpu.MGPUDDPStrategy."
            " Did you mean trainer.strategy.init_args.find_unused_parameters?",
            id="strategy init argument misspelt in the config",
        ),
        pytest.param(
            None,
            ["--trainer.strategy.class_path", "lightning_mgpu.MGPUDDPStrategy"]
            + ["--trainer.strategy.init_args.uneven_batches", "true"]
            + ["--trainer.strategy.init_args.model_averaging_period", "2", *_ONE_DEVICE_ONE_BATCH],
            "trainer.strategy: MGPUDDPStrategy(uneven_batches=True) cannot be combined with model_averaging_period:"
            " post-local SGD steps each rank on its own gradients, so the unequal last batches could not add up to one"
            " device's step. Remove model_averaging_period, or leave uneven_batches off.",
            id="strategy init arguments the strategy refuses together",
        ),
        pytest.param(
            None,
            ["--trainer.max_epochs", "abc"],
            "trainer.max_epochs takes an int >= -1 or null, not 'abc'.",
            id="a value of the wrong type",
        ),
        pytest.param(
            None,
            ["--trainer.devices", "0"],
            "the Trainer refuses trainer.devices '0' (it takes an int > 0, -1 for every device, 'auto', or a list of"
            " device indices such as [0, 1]): `Trainer(devices='0')` value is not a valid input using cpu accelerator."
            " Change trainer.devices.",
            id="devices 0",
        ),
        pytest.param(
            None,
            ["--trainer.enable_progress_bar", "false"],
            "the Trainer refuses trainer.enable_progress_bar false (it takes true, false or null): Trainer was"
            " configured with `enable_progress_bar=False` but found `TQDMProgressBar` in callbacks list. Change"
            " trainer.enable_progress_bar.",
            id="no progress bar beside the config's progress bar",
        ),
    ],
)
def test_a_configuration_that_cannot_start_ends_in_one_line_naming_the_cause_and_the_fix(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config_edit: tuple[str, str] | None,
    overrides: list[str],
    line: str,
) -> None:
    config = QUICKSTART
    if config_edit is not None:
        text = QUICKSTART.read_text()
        assert config_edit[0] in text
        config = tmp_path / "edited.yaml"
        config.write_text(text.replace(config_edit[0], config_edit[1], 1))
    runs = tmp_path / "runs"
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(runs), *overrides]) == 2
    assert capsys.readouterr().err == f"lightning-mgpu fit: {line}\n"
    assert not runs.exists() or not any(runs.rglob("*.ckpt"))


def test_a_config_without_a_root_folder_writes_only_under_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = QUICKSTART.read_text()
    root_line = next(line for line in text.splitlines() if line.strip().startswith("default_root_dir:"))
    (tmp_path / "mine.yaml").write_text(text.replace(root_line + "\n", ""))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # the config's classes live in the repository's examples/
    short = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    assert main(["fit", "--config", "mine.yaml", *short]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.yaml", "runs"]
    assert (tmp_path / "runs" / "version_0" / "config.yaml").is_file()
    assert f"run folder:    {tmp_path / 'runs' / 'version_0'}" in capsys.readouterr().out


_NOISE = [
    "💡 Tip",  # Lightning's advertising
    "LeafSpec",  # Lightning's own use of a torch API that torch deprecates
    "replicates some samples",  # Lightning's padding warning, untrue under mgpu_ddp's evaluation sampler
    "dirpath has changed",  # ModelCheckpoint on a command that saves nothing
    "Modules in train mode",  # the model summary of a model whose parameters sit in no layer
]


@pytest.mark.slow
def test_fit_and_validate_under_mgpu_ddp_print_none_of_lightnings_useless_warnings(tmp_path: Path) -> None:
    def command(*args: str) -> Summary:
        env = clean_env(MASTER_PORT=str(free_ports(1)[0]))
        argv = [sys.executable, "-m", "lightning_mgpu", *args, "--config", "configs/ddp_cpu.yaml", *SMALL_DENSITY]
        argv += ["--trainer.default_root_dir", str(tmp_path)]
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [noise for noise in _NOISE if noise in result.stdout + result.stderr] == []
        return parse_summary(result.stdout)

    checkpoint = command("fit").files["checkpoint"]
    assert command("validate", "--ckpt_path", str(checkpoint)).metrics["val_nll"] > 0


def test_fit_help_says_where_the_model_arguments_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.startswith("usage: lightning-mgpu [options] fit ")
    assert "--model.help CLASS and --data.help CLASS list them" in help_text


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["torch.distributed.launch"])
def test_the_legacy_launcher_runs_the_command_in_two_processes(launch: str, launches: dict[str, Launch]) -> None:
    code, output = launches[launch].result()

    assert code == 0, readable(output)
    summary = parse_summary(output)  # printed by rank 0 alone
    assert output.count("lightning-mgpu fit: done") == 1
    assert summary.steps == DDP_STEPS["ddp_cpu.yaml"]  # each of the 2 ranks trains on half of the samples
    assert summary.files["run folder"].parent == launches[launch].root
    assert summary.files["checkpoint"].is_file()


def terminal(output: bytes) -> list[str]:
    """The lines a terminal shows for ``output``: a carriage return goes back to the start of the line."""
    lines, row, column = [""], 0, 0
    for token in re.findall(r"\x1b\[\d*[A-Za-z]|\r|\n|[^\x1b\r\n]+", output.decode("utf-8", "replace")):
        if token == "\r":
            column = 0
        elif token == "\n":
            row, column = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token.startswith("\x1b["):
            if token.endswith("A"):  # cursor up, as tqdm moves between bars
                row = max(0, row - int(token[2:-1] or 1))
        else:
            line = lines[row].ljust(column)
            lines[row] = line[:column] + token + line[column + len(token) :]
            column += len(token)
    return [line.rstrip() for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["idle devices"])
def test_the_idle_devices_warning_gets_a_line_of_its_own(launch: str, launches: dict[str, Launch]) -> None:
    code, _ = launches[launch].result()
    screen = terminal(launches[launch].log.read_bytes())

    assert code == 0, "\n".join(screen[-40:])
    (warning,) = [line for line in screen if "sat idle" in line]
    assert re.match(
        r"\S+\.py:\d+: (UserWarning: )?mgpu_dp: a batch of 1 row\(s\) was split across 1 of 2 devices.*"
        r"Use a batch size of at least the device count",
        warning,
    )
    assert [line for line in screen if line.startswith("Epoch 0: 100%")]  # the bar, redrawn below the warning


def test_run_folder_holds_metrics_checkpoint_config_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quick = [
        "--config",
        str(QUICKSTART),
        "--trainer.limit_val_batches",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    three_steps = ["--trainer.max_steps", "3", "--trainer.limit_train_batches", "3", "--trainer.log_every_n_steps", "1"]
    assert main(["fit", *quick, *three_steps]) == 0
    summary = parse_summary(capsys.readouterr().out)

    run_folder = tmp_path / "version_0"
    assert summary.subcommand == "fit"
    assert summary.steps == 3
    assert summary.files == {
        "run folder": run_folder,
        "config.yaml": run_folder / "config.yaml",
        "metrics.csv": run_folder / "metrics.csv",
        "density.png": run_folder / "density.png",  # the example's plot callback
        "checkpoint": run_folder / "checkpoints" / "epoch=0-step=3.ckpt",
    }
    rows = read_metrics(run_folder)
    assert len(column(rows, "train_nll_step")) == 3
    assert column(rows, "val_nll") == [pytest.approx(summary.metrics["val_nll"], rel=1e-3)]
    assert 4 < summary.metrics["val_nll"] < 10
    config = yaml.safe_load((run_folder / "config.yaml").read_text())
    assert config["trainer"]["max_steps"] == 3
    assert config["model"]["class_path"] == "examples.density.DensityModel"
    # logger: null reruns as this run did (a new run folder); the comment says which loggers that gave.
    assert config["trainer"]["logger"] is None
    assert re.search(
        r"^  logger: null  # lightning-mgpu's default: lightning\.pytorch\.loggers\.CSVLogger( and \S+)?, writing into"
        r" this folder$",
        (run_folder / "config.yaml").read_text(),
        flags=re.MULTILINE,
    )

    state = torch.load(summary.files["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert {"H_0", "a_0", "b_0", "H_3", "b_3"} <= state.keys()  # the model's own names, no "module." prefix

    # The checkpoint is the one to use next: validating it gives the final val_nll again, in a new run folder.
    assert main(["validate", *quick, "--ckpt_path", str(summary.files["checkpoint"])]) == 0
    validated = parse_summary(capsys.readouterr().out)
    assert validated.subcommand == "validate"
    assert validated.checkpoint_used == summary.files["checkpoint"]
    assert validated.metrics["val_nll"] == pytest.approx(summary.metrics["val_nll"], abs=1e-6)
    assert validated.files["run folder"] == tmp_path / "version_1"


def test_summaries_of_test_and_predict_name_the_checkpoint_and_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quick = ["--config", str(QUICKSTART), *SMALL_DENSITY[2:], "--trainer.default_root_dir", str(tmp_path)]
    assert main(["fit", *quick, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"]) == 0
    checkpoint = parse_summary(capsys.readouterr().out).files["checkpoint"]

    assert main(["test", *quick, "--ckpt_path", str(checkpoint)]) == 0
    tested = parse_summary(capsys.readouterr().out)
    assert (tested.steps, tested.checkpoint_used) == (None, checkpoint)
    assert 4 < tested.metrics["test_nll"] < 10
    assert tested.files == {
        "run folder": tmp_path / "version_1",
        "config.yaml": tmp_path / "version_1" / "config.yaml",
        "metrics.csv": tmp_path / "version_1" / "metrics.csv",
    }

    assert main(["predict", *quick, "--ckpt_path", str(checkpoint)]) == 0
    predicted = parse_summary(capsys.readouterr().out)
    assert (predicted.steps, predicted.checkpoint_used) == (None, checkpoint)
    assert predicted.files == {  # nothing is logged in predict, so there is no metrics.csv to list
        "run folder": tmp_path / "version_2",
        "config.yaml": tmp_path / "version_2" / "config.yaml",
        "predictions.csv": tmp_path / "version_2" / "predictions.csv",
    }
    with open(predicted.files["predictions.csv"]) as predictions:
        assert len(list(csv.reader(predictions))) == 1 + 4000  # header and the test samples

    # A command that fails before writing anything but its config leaves no run folder behind, and says no more.
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        main(["test", *quick, "--ckpt_path", str(tmp_path / "missing.ckpt")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["version_0", "version_1", "version_2"]
    assert "lightning-mgpu" not in capsys.readouterr().out


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--config", str(QUICKSTART), "--trainer.max_steps", "2", "--model.init_args.lr", "0.01"]
    args += ["--data.init_args.batch_size", "100", "--trainer.default_root_dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--print_config"])
    assert exit_.value.code in (0, None)
    printed = capsys.readouterr().out
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)

    with pytest.raises(SystemExit):
        main(["fit", "--config", str(saved), "--print_config"])
    assert capsys.readouterr().out == printed

    assert main(["fit", "--config", str(saved)]) == 0
    summary = parse_summary(capsys.readouterr().out)
    resolved = yaml.safe_load(printed)
    assert yaml.safe_load((tmp_path / "runs" / "version_0" / "config.yaml").read_text()) == resolved
    assert summary.steps == resolved["trainer"]["max_steps"] == 2
    assert resolved["model"]["init_args"]["lr"] == 0.01
    assert resolved["data"]["init_args"]["batch_size"] == 100


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["README usage"])
def test_readme_usage_example_runs(launch: str, launches: dict[str, Launch]) -> None:
    code, output = launches[launch].result()

    assert code == 0, readable(output)
    assert re.search(r"^strategy MGPUDPStrategy devices 2$", output, flags=re.MULTILINE)
    assert re.search(r"^global_step 4$", output, flags=re.MULTILINE)  # 64 rows in batches of 16, one epoch
    train_mse = float(re.search(r"^train_mse (\S+)$", output, flags=re.MULTILINE).group(1))
    assert 0 < train_mse < 10  # targets ~ N(0, 1)
