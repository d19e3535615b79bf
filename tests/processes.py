"""What the tests that start processes share: free ports, a clean environment, and running ``scripts/ddp_train.py``.

Every test that uses these starts real processes and must carry ``@pytest.mark.slow`` (``tests/conftest.py`` fails an
unmarked test that starts a Python process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Regressor, loader, parameters, regression_data, trainer

DDP_SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
"""The two-process training script: ``--out`` receives ``rank{N}.json`` reports and ``params.pt``."""
DDP_TIMEOUT = 180
ZOO_SCRIPT = Path(__file__).parent / "scripts" / "zoo_ddp.py"
"""Trains entries of a zoo module (``tests/zoo.py``, ``tests/library_zoo.py``) in one two-process mgpu_ddp job."""

SELECTED_LAUNCHES = pytest.StashKey[set[str]]()
"""``config.stash`` key: the ``launch`` parameters of the selected tests that request a ``launches`` fixture."""
SELECTED_BLOCKS = pytest.StashKey[list[Any]]()
"""``config.stash`` key: the ``block`` parameters of the selected tests that request a ``jobs`` fixture, in order."""


def start_in_session(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own, its output and errors going to ``log``.

    The ranks a launcher starts share that session, so ``stop_session`` ends them all.
    """
    with open(log, "wb") as output:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_session(process: subprocess.Popen[Any]) -> None:
    """Kill ``process`` and every process of its session, if it is still running, and wait for it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def still_running(out: Path, wait: float = 60.0) -> list[int]:
    """The processes that wrote their pid to ``out/pid-*`` and still run after up to ``wait`` seconds; killed then.

    A test that expects every rank to end checks that this is empty (and that the pid files are all there).
    """
    pids = [int(path.read_text()) for path in out.glob("pid-*")]
    deadline = time.monotonic() + wait
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different free ports: every socket stays open until all are chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or cluster's variables, one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(command: list[str], env: dict[str, str], timeout: float = DDP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, capturing its text output; a failure is for the caller to assert."""
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def run_ddp_script(out: Path, *args: str, timeout: float = DDP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/ddp_train.py --out out *args`` under Lightning's own launcher on a free port."""
    command = [sys.executable, str(DDP_SCRIPT), "--out", str(out), *args]
    return run(command, clean_env(MASTER_PORT=str(free_port())), timeout)


def rank_report(out: Path, rank: int) -> dict[str, Any]:
    """The JSON report that ``scripts/ddp_train.py`` wrote for ``rank``."""
    return json.loads((out / f"rank{rank}.json").read_text())


def single_device_parameters(epochs: int = 2, batch: int = 4) -> dict[str, torch.Tensor]:
    """A Regressor's parameters after training in this process on one device: what every DDP run must match."""
    model = Regressor()
    trainer(max_epochs=epochs).fit(model, loader(regression_data(), batch))
    return parameters(model)


def run_zoo_job(zoo: str, out: Path, names: Sequence[str], timeout: float) -> str:
    """Train ``names`` of the zoo module ``zoo`` in one two-process mgpu_ddp job (``scripts/zoo_ddp.py``).

    Each rank leaves ``<name>.rank<r>.pt`` or ``<name>.rank<r>.error`` in ``out`` (read them with ``zoo_result``).
    The job runs in a session of its own, so a hang past ``timeout`` ends every rank. Returns the job's stderr.
    """
    command = [sys.executable, str(ZOO_SCRIPT), "--zoo", zoo, "--out", str(out), *names]
    process = subprocess.Popen(
        command,
        env=clean_env(MASTER_PORT=str(free_port())),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the ranks Lightning starts share this session
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_session(process)
        _, stderr = process.communicate()
        stderr += f"\nThe job was killed after {timeout:.0f} s."
    return stderr


def zoo_result(out: Path, name: str, rank: int, stderr: str) -> dict[str, Any]:
    """What rank ``rank`` of a ``run_zoo_job`` job saved for ``name``; the test fails with the reason if nothing."""
    error = out / f"{name}.rank{rank}.error"
    if error.exists():
        pytest.fail(f"{name} failed on rank {rank}:\n{_tail(error.read_text())}")
    result = out / f"{name}.rank{rank}.pt"
    if not result.exists():
        pytest.fail(f"the job ended before rank {rank} finished {name}:\n{_tail(stderr)}")
    saved: dict[str, Any] = torch.load(result, weights_only=True)
    return saved


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])
