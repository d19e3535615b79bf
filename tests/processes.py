"""What the tests that start processes share: free ports, a clean environment, and running ``scripts/ddp_train.py``.

Every test that uses these starts real processes and must carry ``@pytest.mark.slow`` (``tests/conftest.py`` fails an
unmarked test that starts a Python process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Regressor, loader, parameters, regression_data, trainer

DDP_SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
"""The two-process training script: ``--out`` receives ``rank{N}.json`` reports and ``params.pt``."""
DDP_TIMEOUT = 180

SELECTED_LAUNCHES = pytest.StashKey[set[str]]()
"""``config.stash`` key: the ``launch`` parameters of the selected tests that request a ``launches`` fixture."""


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
