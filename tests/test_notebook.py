"""``examples/notebook.ipynb``, executed headless in a real Jupyter kernel that runs this interpreter.

The notebook trains under ``mgpu_dp`` twice in one kernel, runs the doctor and checks that no replica thread outlives
``fit``; here its outputs are read back and checked, and the kernel process must be gone once the client is done.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
KERNEL_NAME = "lightning-mgpu-test"
CELL_TIMEOUT = 180
FIT_METRIC = re.compile(r"^fit (\d): val_nll = (\S+) bits after (\d+) steps$", re.MULTILINE)


def kernelspec_for_this_interpreter(directory: Path) -> Path:
    """Write a kernelspec under ``directory/kernels`` whose kernel is ``sys.executable`` running ipykernel."""
    spec = directory / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel_json = {"argv": argv, "display_name": "lightning_mgpu tests", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel_json))
    return directory


def outputs_of(cell: Any, output_type: str, name: str | None = None) -> str:
    """The text of ``cell``'s outputs of one type (and stream name)."""
    return "".join(
        output.get("text", "")
        for output in cell.get("outputs", [])
        if output["output_type"] == output_type and (name is None or output.get("name") == name)
    )


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno != errno.ESRCH
    return True


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert notebook.nbformat == 4
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code_cells)


@pytest.mark.slow  # starts a kernel process
@pytest.mark.timeout(CELL_TIMEOUT + 60)
def test_notebook_runs_in_a_kernel_of_this_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Jupyter looks for kernelspecs under $JUPYTER_PATH/kernels first.
    monkeypatch.setenv("JUPYTER_PATH", str(kernelspec_for_this_interpreter(tmp_path / "jupyter")))
    kernel: dict[str, Any] = {}

    def on_notebook_start(notebook: Any) -> None:
        kernel["argv"] = client.km.kernel_spec.argv
        kernel["pid"] = pid = client.km.provisioner.pid
        if os.path.exists(f"/proc/{pid}/exe"):
            kernel["exe"] = os.path.realpath(f"/proc/{pid}/exe")

    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # where Jupyter starts a notebook's kernel
        on_notebook_start=on_notebook_start,
    )
    started = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - started

    # The kernel ran this interpreter, and the client shut it down: no process is left.
    assert kernel["argv"][0] == sys.executable
    assert kernel.get("exe", os.path.realpath(sys.executable)) == os.path.realpath(sys.executable)
    pid = kernel["pid"]
    assert isinstance(pid, int)
    assert not process_exists(pid), f"the kernel process {pid} is still running"
    assert elapsed < CELL_TIMEOUT

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells)
    errors = [output for cell in code_cells for output in cell.outputs if output["output_type"] == "error"]
    assert errors == [], "\n".join(f"{error['ename']}: {error['evalue']}" for error in errors)
    stdout = "\n".join(outputs_of(cell, "stream", "stdout") for cell in code_cells)

    gpus = torch.cuda.device_count() >= 2  # the notebook uses every GPU when there are 2 or more
    assert ("accelerator='gpu', devices=-1" if gpus else "accelerator='cpu', devices=2") in stdout

    # Both fits ran to the end and printed a finite negative log-likelihood in a sane range (bits per sample of a
    # mixture spread over about 40 units: a few bits; the untrained model gives 5.56).
    fits = FIT_METRIC.findall(stdout)
    assert [fit for fit, _, _ in fits] == ["1", "2"], stdout
    for _, value, steps in fits:
        nll = float(value)
        assert math.isfinite(nll)
        assert 1.0 < nll < 12.0
        assert int(steps) == 16  # 2 epochs of 2000 samples in batches of 250: each fit started from step 0

    # The doctor's report: its header, the comparison tables and a clean verdict.
    assert "lightning-mgpu doctor: DensityModel, probe batch of 250 rows split 125 + 125 across 2 virtual" in stdout
    assert "judged for mgpu_dp" in stdout
    assert "Findings: none" in stdout
    assert "0 errors, 0 warnings: exit 0" in stdout

    # Replica threads ran during fit and none is alive after it.
    replicas = torch.cuda.device_count() if gpus else 2
    seen = sorted(f"mgpu-replica-{index}" for index in range(replicas))
    assert f"replica threads seen during fit: {seen}" in stdout
    live_threads = re.search(r"^live threads now \((\d+)\): (.*)$", stdout, re.MULTILINE)
    assert live_threads is not None, stdout
    assert "mgpu-replica" not in live_threads.group(2)
    assert "no replica threads left" in stdout
