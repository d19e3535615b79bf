"""The versions ``pyproject.toml`` admits are those CI runs the suite on, and the installed ones are among them."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import lightning
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(line).name: Requirement(line) for line in project["dependencies"]}


def _floor(requirement: Requirement) -> Version:
    floors = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    assert len(floors) == 1, f"{requirement} should have one >= floor"
    return floors[0]


def _ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text()


def _oldest(name: str) -> Version:
    pinned = re.search(rf'^OLDEST_{name.upper()}="([\d.]+)"$', _ci_script(), flags=re.MULTILINE)
    assert pinned, f".ci/run names the oldest {name} it runs the suite on"
    return Version(pinned.group(1))


def test_the_oldest_lightning_ci_runs_is_the_floor() -> None:
    assert _oldest("lightning").release[:2] == _floor(_requirements()["lightning"]).release[:2]


def test_the_oldest_torch_ci_runs_is_the_floor() -> None:
    assert _oldest("torch").release[:2] == _floor(_requirements()["torch"]).release[:2]
    assert '-m pip install "torch==$OLDEST_TORCH"' in _ci_script()


def test_ci_sets_up_and_tests_exactly_as_the_readme_says() -> None:
    readme = (ROOT / "README.md").read_text()
    setup_and_test = r"^(python -m pip install torch==.*) && (python -m pip install -e .*) && (python -m pytest -q)$"
    command = re.search(setup_and_test, readme, flags=re.MULTILINE)
    assert command, "the README shows one line that sets up and runs the tests"
    lines = _ci_script().splitlines()
    assert [line for line in lines if line in command.groups()] == list(command.groups())


def test_the_python_floor_is_the_python_ci_runs() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    assert sys.version_info >= (3, 11)


def test_the_installed_versions_are_admitted() -> None:
    requirements = _requirements()
    assert requirements["lightning"].specifier.contains(lightning.__version__)
    assert requirements["torch"].specifier.contains(Version(torch.__version__).base_version)
