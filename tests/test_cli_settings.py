"""``lightning-mgpu fit`` with a bad value: one line with the full key, the value, what it takes, and exit code 2.

Each row of ``BAD_VALUES`` is given twice, in a small config on top of ``configs/quickstart.yaml`` and as flags, and
fails before training starts, in this process. A value the Trainer accepts but cannot run is refused before the Trainer
is built; an exception of the Trainer's constructor is its refusal when it comes from Lightning's code, while the
project's own code (a model, a step, a callback) keeps its exception and traceback.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_mgpu.cli import main
from lightning_mgpu.cli.lightning_cli import CommandError, MGPULightningCLI

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples.density, as the CLI resolves it from the repository root

DDP = {"trainer.strategy.class_path": "lightning_mgpu.MGPUDDPStrategy"}
DP = {"trainer.strategy.class_path": "lightning_mgpu.MGPUDPStrategy"}


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])  # pytest's own arguments are not the CLI's


@dataclass(frozen=True)
class BadValue:
    """Settings written as in YAML or after a flag, and what the one line must say."""

    settings: dict[str, str]
    key: str  # the full key the line names
    says: tuple[str, ...]  # what the key takes (its choices) or the fix, each a part of the line
    value: str | None = None  # the value as given, when the line names it (a misspelt key's does not)
    flags: bool = True  # False where argparse takes the flag for a longer one (--trainer.max_epoch: max_epochs)
    setting: str | None = field(default=None, compare=False)  # the error's ``setting``, where asserted


BAD_VALUES: dict[str, BadValue] = {
    # trainer.*: jsonargparse's type check, with what the Trainer's annotation takes
    "max_epochs not a number": BadValue(
        {"trainer.max_epochs": "abc"}, "trainer.max_epochs", ("takes an int >= -1 or null, not 'abc'",), "abc"
    ),
    "precision not a choice": BadValue(
        {"trainer.precision": "15"}, "trainer.precision", ("takes one of", "16-mixed", "bf16-mixed", "32-true"), "15"
    ),
    # trainer.*: values the Trainer itself refuses, in its own words, with what the key takes
    "devices a word": BadValue(
        {"trainer.devices": "two"},
        "trainer.devices",
        ("the Trainer refuses trainer.devices 'two'", "an int > 0, -1 for every device", "Change trainer.devices"),
        "two",
        setting="Trainer.devices",
    ),
    "devices negative": BadValue(
        {"trainer.devices": "-3"}, "trainer.devices", ("an int > 0", "Change trainer.devices"), "-3"
    ),
    "devices a fraction": BadValue({"trainer.devices": "1.5"}, "trainer.devices", ("an int > 0",), "1.5"),
    "devices zero": BadValue({"trainer.devices": "0"}, "trainer.devices", ("an int > 0", "trainer.devices"), "0"),
    "accelerator unknown": BadValue(
        {"trainer.accelerator": "gpux"},
        "trainer.accelerator",
        ("it takes one of auto, cpu, cuda, gpu", "Change trainer.accelerator"),
        "gpux",
    ),
    "accelerator unavailable": BadValue(
        {"trainer.accelerator": "tpu"},
        "trainer.accelerator",
        ("not 'tpu'", "XLAAccelerator is not available here", "Use --trainer.accelerator cpu"),
        "tpu",
    ),
    "limit_train_batches above 1.0": BadValue(
        {"trainer.limit_train_batches": "1.5"},
        "trainer.limit_train_batches",
        ("a float in [0.0, 1.0]", "Change trainer.limit_train_batches"),
        "1.5",
    ),
    "max_epochs below -1": BadValue({"trainer.max_epochs": "-2"}, "trainer.max_epochs", ("an int >= -1",), "-2"),
    # trainer.*: values the Trainer accepts but cannot run, refused before it is built
    "num_nodes zero": BadValue({"trainer.num_nodes": "0"}, "trainer.num_nodes", ("takes an int >= 1, not 0.",), "0"),
    "accumulate_grad_batches zero": BadValue(
        {"trainer.accumulate_grad_batches": "0"},
        "trainer.accumulate_grad_batches",
        ("takes an int >= 1, not 0.",),
        "0",
        setting="Trainer.accumulate_grad_batches",
    ),
    "accumulate_grad_batches negative": BadValue(
        {"trainer.accumulate_grad_batches": "-2"}, "trainer.accumulate_grad_batches", ("an int >= 1",), "-2"
    ),
    "check_val_every_n_epoch zero": BadValue(
        {"trainer.check_val_every_n_epoch": "0"}, "trainer.check_val_every_n_epoch", ("an int >= 1 or null",), "0"
    ),
    "val_check_interval zero": BadValue(
        {"trainer.val_check_interval": "0"}, "trainer.val_check_interval", ("a number > 0",), "0"
    ),
    "gradient_clip_val negative": BadValue(
        {"trainer.gradient_clip_val": "-1.0"}, "trainer.gradient_clip_val", ("a number >= 0",), "-1.0"
    ),
    "min_epochs negative": BadValue({"trainer.min_epochs": "-1"}, "trainer.min_epochs", ("an int >= 0",), "-1"),
    "min_steps negative": BadValue({"trainer.min_steps": "-5"}, "trainer.min_steps", ("an int >= 0",), "-5"),
    "num_sanity_val_steps below -1": BadValue(
        {"trainer.num_sanity_val_steps": "-2"}, "trainer.num_sanity_val_steps", ("an int >= -1",), "-2"
    ),
    "log_every_n_steps negative": BadValue(
        {"trainer.log_every_n_steps": "-1"}, "trainer.log_every_n_steps", ("an int >= 0",), "-1"
    ),
    "trainer key misspelt": BadValue(
        {"trainer.max_epoch": "3"}, "trainer.max_epoch", ("Did you mean trainer.max_epochs?",), flags=False
    ),
    # model.* and data.*: the class's init arguments, with what the annotation of each takes
    "model lr a word": BadValue(
        {"model.init_args.lr": "fast"},
        "model.init_args.lr",
        ("takes float, not 'fast'",),
        "fast",
        setting="DensityModel.lr",
    ),
    "model hidden_filters a word": BadValue(
        {"model.init_args.hidden_filters": "x"}, "model.init_args.hidden_filters", ("takes list of int",), "x"
    ),
    "model init_scale a list": BadValue(
        {"model.init_args.init_scale": "[1]"}, "model.init_args.init_scale", ("takes float",), "[1]"
    ),
    "model argument misspelt": BadValue(
        {"model.init_args.bach_size": "3"},
        "model.init_args.bach_size",
        ("not an argument of examples.density.DensityModel", "it takes channels, hidden_filters, init_scale, lr"),
    ),
    "data batch_size a word": BadValue(
        {"data.init_args.batch_size": "x"}, "data.init_args.batch_size", ("takes int, not 'x'",), "x"
    ),
    "data shuffle a word": BadValue(
        {"data.init_args.shuffle": "maybe"}, "data.init_args.shuffle", ("takes true or false",), "maybe"
    ),
    "data argument misspelt": BadValue(
        {"data.init_args.num_sampels": "10"},
        "data.init_args.num_sampels",
        ("Did you mean data.init_args.num_samples?",),
    ),
    # the strategy's own keys
    "ddp find_unused_parameters a word": BadValue(
        {**DDP, "trainer.strategy.init_args.find_unused_parameters": "maybe"},
        "trainer.strategy.init_args.find_unused_parameters",
        ("takes true or false",),
        "maybe",
    ),
    "ddp start_method not a choice": BadValue(
        {**DDP, "trainer.strategy.init_args.start_method": "forks"},
        "trainer.strategy.init_args.start_method",
        ("takes one of popen, spawn, fork, forkserver",),
        "forks",
        setting="MGPUDDPStrategy.start_method",
    ),
    "ddp argument misspelt": BadValue(
        {**DDP, "trainer.strategy.init_args.find_unused_parameter": "true"},
        "trainer.strategy.init_args.find_unused_parameter",
        ("Did you mean trainer.strategy.init_args.find_unused_parameters?",),
    ),
    "dp sync_batchnorm a word": BadValue(
        {**DP, "trainer.strategy.init_args.sync_batchnorm": "maybe"},
        "trainer.strategy.init_args.sync_batchnorm",
        ("takes true or false",),
        "maybe",
    ),
    "dp device_weights a word": BadValue(
        {**DP, "trainer.strategy.init_args.device_weights": "x"},
        "trainer.strategy.init_args.device_weights",
        ("takes list of float or null",),
        "x",
    ),
    "dp argument misspelt": BadValue(
        {**DP, "trainer.strategy.init_args.device_weight": "[1, 1]"},
        "trainer.strategy.init_args.device_weight",
        ("Did you mean trainer.strategy.init_args.device_weights?",),
    ),
    "init_args of a strategy without its class": BadValue(
        {"trainer.strategy.init_args.sync_batchnorm": "false"},
        "trainer.strategy.init_args.sync_batchnorm",
        ("cannot be set", "--trainer.strategy.class_path", "--trainer.strategy.init_args.sync_batchnorm false"),
        "false",
    ),
}
WAYS = [
    pytest.param(case, way, id=f"{name}, {way}")
    for name, case in BAD_VALUES.items()
    for way in ("yaml", "flags")
    if way == "yaml" or case.flags
]


def _yaml(settings: dict[str, str]) -> str:
    """``settings`` as a config: dotted keys nested, each value written as given."""
    tree: dict = {}
    for key, value in settings.items():
        *parents, last = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value

    def lines(node: dict, depth: int) -> Iterator[str]:
        for name, value in node.items():
            if isinstance(value, dict):
                yield f"{'  ' * depth}{name}:"
                yield from lines(value, depth + 1)
            else:
                yield f"{'  ' * depth}{name}: {value}"

    return "\n".join(lines(tree, 0)) + "\n"


def _args(case: BadValue, way: str, tmp_path: Path) -> list[str]:
    if way == "flags":
        return [arg for key, value in case.settings.items() for arg in (f"--{key}", value)]
    config = tmp_path / "bad.yaml"
    config.write_text(_yaml(case.settings))
    return ["--config", str(config)]


def _fit(args: list[str], tmp_path: Path) -> list[str]:
    return ["fit", "--config", str(QUICKSTART), "--trainer.default_root_dir", str(tmp_path / "runs"), *args]


@pytest.mark.parametrize(("case", "way"), WAYS)
def test_a_bad_value_ends_in_one_line_with_its_key_its_value_and_what_it_takes(
    case: BadValue, way: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_fit(_args(case, way, tmp_path), tmp_path)) == 2

    error = capsys.readouterr().err
    assert error.startswith("lightning-mgpu fit: ")
    assert error.endswith("\n")
    assert error.count("\n") == 1, error
    assert re.search(rf"(?<![\w.]){re.escape(case.key)}(?![\w.])", error), error
    if case.value is not None:
        assert re.search(rf"(?<![\w.-]){re.escape(case.value)}(?!\w|\.\d)", error), error
    for part in case.says:
        assert part in error
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))


@pytest.mark.parametrize("name", [name for name, case in BAD_VALUES.items() if case.setting is not None])
def test_a_bad_values_error_names_the_setting_as_an_attribute(name: str, tmp_path: Path) -> None:
    case = BAD_VALUES[name]
    with pytest.raises(CommandError) as raised:
        MGPULightningCLI(args=_fit(_args(case, "flags", tmp_path), tmp_path))
    assert raised.value.setting == case.setting


def _documented_messages() -> list[str]:
    """The messages of README's troubleshooting row for bad values and of docs/cli.md's paragraph about them."""
    readme = (ROOT / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith("| `lightning-mgpu fit: 'trainer.max_epoch'")]
    cells = row.split(" | ")
    quoted = re.findall(r"`([^`]+)`", cells[0])
    docs = (ROOT / "docs" / "cli.md").read_text()
    quoted += re.findall(r"`(lightning-mgpu fit: [^`]+)`", docs)
    return [text if text.startswith("lightning-mgpu fit: ") else f"lightning-mgpu fit: {text}" for text in quoted]


def test_the_documented_messages_are_the_commands_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    messages = _documented_messages()
    assert len(messages) >= 10

    def lines(message: str) -> Iterator[str]:
        """The lines of the table's rows whose key the message names, each way they can be given."""
        for case in BAD_VALUES.values():
            if re.search(rf"{re.escape(case.key)}(?![\w.])", message):
                for way in ("yaml", "flags") if case.flags else ("yaml",):
                    assert main(_fit(_args(case, way, tmp_path), tmp_path)) == 2
                    yield capsys.readouterr().err.rstrip("\n")

    for message in messages:
        pattern = ".*".join(re.escape(part) for part in message.split("…"))
        assert any(re.fullmatch(pattern, line) for line in lines(message)), message


OWN_CODE = """
from lightning.pytorch.callbacks import Callback
from examples.density import DensityModel


class RefusingModel(DensityModel):
    def __init__(self, *args, **kwargs):
        raise ValueError("RefusingModel refuses to be built")


class FailingStepModel(DensityModel):
    def training_step(self, batch, batch_idx):
        raise TypeError("FailingStepModel's training_step fails")


class KeylessCallback(Callback):
    def state_dict(self):
        return {}

    @property
    def state_key(self):  # read by the Trainer's constructor
        raise ValueError("KeylessCallback has no state key")
"""


@pytest.fixture
def own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A module of the project's own classes, importable as ``own_code``."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "own_code.py").write_text(OWN_CODE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder / "own_code.py"
    sys.modules.pop("own_code", None)


def _raised_in(error: BaseException, path: Path) -> bool:
    """Whether ``error`` or an exception it was raised from was raised in the file at ``path``."""
    chain: BaseException | None = error
    while chain is not None:
        frames = traceback.extract_tb(chain.__traceback__)
        if frames and Path(frames[-1].filename) == path:
            return True
        chain = chain.__cause__ or chain.__context__
    return False


@pytest.mark.parametrize(
    ("args", "raises", "message"),
    [
        pytest.param(
            ["--model.class_path", "own_code.RefusingModel"], ValueError, "RefusingModel refuses", id="model __init__"
        ),
        pytest.param(
            ["--model.class_path", "own_code.FailingStepModel", "--trainer.fast_dev_run", "1"],
            TypeError,
            "training_step fails",
            id="training_step",
        ),
        pytest.param(
            ["--trainer.callbacks+=own_code.KeylessCallback"],
            ValueError,
            "KeylessCallback has no state key",
            id="a callback, in the Trainer's constructor",
        ),
    ],
)
def test_the_projects_own_exception_keeps_its_traceback(
    args: list[str], raises: type[Exception], message: str, own_code: Path, tmp_path: Path
) -> None:
    with pytest.raises(raises) as raised:
        main(_fit(args, tmp_path))
    assert _raised_in(raised.value, own_code)
    text = "".join(traceback.format_exception(raised.value))
    assert message in text
