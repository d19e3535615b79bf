"""The versions ``pyproject.toml`` admits are those CI runs the suite on, at both ends, and the installed ones too."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import lightning
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _requirements() -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in _project()["dependencies"]}  # type: ignore[attr-defined]


def _floor(specifier: SpecifierSet) -> Version:
    floors = [Version(spec.version) for spec in specifier if spec.operator == ">="]
    assert len(floors) == 1, f"{specifier} should have one >= floor"
    return floors[0]


def _next_minor(version: Version) -> Version:
    return Version(f"{version.major}.{version.minor + 1}")


def _ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text()


def _ci_pin(name: str) -> Version:
    pinned = re.search(rf'^{name}="([\d.]+)"$', _ci_script(), flags=re.MULTILINE)
    assert pinned, f".ci/run names {name}"
    return Version(pinned.group(1))


def _admits_exactly_up_to(specifier: SpecifierSet, floor: Version, newest: Version) -> None:
    """``specifier`` admits ``floor`` and ``newest`` (the ends CI runs) and nothing below or past their minors."""
    assert _floor(specifier) == Version(f"{floor.major}.{floor.minor}"), f"{specifier}: the floor is not {floor}"
    for end in (floor, newest):
        assert specifier.contains(end), f"{specifier} leaves out {end}, which CI runs"
    assert not specifier.contains(_next_minor(newest)), f"{specifier} admits {_next_minor(newest)}, which CI never runs"


def test_torch_is_admitted_from_the_floor_to_the_newest_that_ci_runs() -> None:
    specifier = _requirements()["torch"].specifier
    _admits_exactly_up_to(specifier, _ci_pin("FLOOR_TORCH"), _ci_pin("NEWEST_TORCH"))
    for pin in ("FLOOR_TORCH", "NEWEST_TORCH"):
        assert re.search(rf'-m pip install (--[\w-]+ )*"torch==\${pin}"', _ci_script()), f".ci/run installs ${pin}"


def test_lightning_is_admitted_from_the_floor_that_ci_runs_to_its_newest_release() -> None:
    specifier = _requirements()["lightning"].specifier
    _admits_exactly_up_to(specifier, _ci_pin("FLOOR_LIGHTNING"), Version(lightning.__version__))
    assert '"lightning==$FLOOR_LIGHTNING"' in _ci_script()


def test_python_is_admitted_from_3_11_to_the_newest_that_ci_runs() -> None:
    requires = SpecifierSet(str(_project()["requires-python"]))
    _admits_exactly_up_to(requires, Version("3.11"), _ci_pin("NEWEST_PYTHON"))
    assert sys.version_info >= (3, 11)


def test_ci_sets_up_and_tests_exactly_as_the_readme_says() -> None:
    readme = (ROOT / "README.md").read_text()
    setup_and_test = r"^(python -m pip install torch==.*) && (python -m pip install -e .*) && (python -m pytest -q)$"
    command = re.search(setup_and_test, readme, flags=re.MULTILINE)
    assert command, "the README shows one line that sets up and runs the tests"
    lines = _ci_script().splitlines()
    assert [line for line in lines if line in command.groups()] == list(command.groups())


def test_the_installed_versions_are_admitted() -> None:
    requirements = _requirements()
    assert requirements["lightning"].specifier.contains(lightning.__version__)
    assert requirements["torch"].specifier.contains(Version(torch.__version__).base_version)
    assert SpecifierSet(str(_project()["requires-python"])).contains(".".join(map(str, sys.version_info[:3])))
