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


def test_the_oldest_lightning_ci_runs_is_the_floor() -> None:
    oldest = re.search(r'^OLDEST_LIGHTNING="([\d.]+)"$', _ci_script(), flags=re.MULTILINE)
    assert oldest, ".ci/run names the oldest Lightning it runs the suite on"
    assert Version(oldest.group(1)).release[:2] == _floor(_requirements()["lightning"]).release[:2]


def test_the_torch_ci_installs_is_the_floor() -> None:
    pinned = re.search(r"pip install torch==([\d.]+)", _ci_script())
    assert pinned, ".ci/run installs a pinned torch first, as the README does"
    assert Version(pinned.group(1)).release[:2] == _floor(_requirements()["torch"]).release[:2]
    assert pinned.group(0) in (ROOT / "README.md").read_text()


def test_the_python_floor_is_the_python_ci_runs() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    assert sys.version_info >= (3, 11)


def test_the_installed_versions_are_admitted() -> None:
    requirements = _requirements()
    assert requirements["lightning"].specifier.contains(lightning.__version__)
    assert requirements["torch"].specifier.contains(Version(torch.__version__).base_version)
