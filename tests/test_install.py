"""Installing the package: it keeps the torch already installed, and its wheel carries the type hints' marker."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    """pip in this interpreter, offline: what is installed here (and local wheels) is all it may use."""
    command = [sys.executable, "-m", "pip", *args, "--no-index", "--no-build-isolation", "--disable-pip-version-check"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def _by_name(lines: list[str]) -> dict[str, str]:
    return {Requirement(line).name: str(Requirement(line).specifier) for line in lines}


def test_the_test_extra_carries_the_build_backend_these_tests_build_with() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = _by_name(pyproject["build-system"]["requires"])
    test_base = _by_name(pyproject["project"]["optional-dependencies"]["test-base"])
    assert {name: test_base.get(name) for name in build} == build, "building offline needs the build-system's tools"


@pytest.mark.slow
def test_installing_the_package_keeps_the_torch_already_installed(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = _pip("install", "--dry-run", "--quiet", "--report", str(report), f"{ROOT}[test-base]")
    assert result.returncode == 0, f"pip cannot install the package next to torch {torch.__version__}:\n{result.stderr}"
    planned = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "torch" not in planned, f"installing the package would replace torch {torch.__version__}: {planned}"
    assert set(planned) == {"lightning-mgpu"}, f"everything else is installed already: {planned}"


@pytest.mark.slow
def test_the_wheel_marks_the_package_as_typed(tmp_path: Path) -> None:
    result = _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path), str(ROOT))
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("lightning_mgpu-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "lightning_mgpu/py.typed" in names
    assert "lightning_mgpu/__init__.py" in names
