"""A script that calls ``parse_local_rank()`` runs under every launcher, Lightning's own included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import clean_env, free_port

import lightning_mgpu

SCRIPT = Path(__file__).parent / "scripts" / "local_rank_train.py"
LAUNCHERS = {
    "lightning": [],
    "torch.distributed.launch": ["-m", "torch.distributed.launch", "--nproc_per_node", "2"],
    "torchrun": ["-m", "torch.distributed.run", "--nproc-per-node", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_parse_local_rank_lets_every_launcher_start_both_ranks(tmp_path: Path, launcher: str) -> None:
    port = str(free_port())
    command = [sys.executable, *LAUNCHERS[launcher]]
    if launcher != "lightning":
        command += ["--master-port" if launcher == "torchrun" else "--master_port", port]
    command += [str(SCRIPT), "--out", str(tmp_path)]
    result = subprocess.run(
        command, env=clean_env(MASTER_PORT=port), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("rank*.done")) == ["rank0.done", "rank1.done"]
    assert sorted(path.read_text() for path in tmp_path.glob("rank*.done")) == ["0", "1"]


def test_without_a_rank_flag_local_rank_stays_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))  # parse_local_rank writes LOCAL_RANK; no later test sees it
    os.environ.pop("LOCAL_RANK", None)
    assert lightning_mgpu.parse_local_rank(["train.py", "--lr", "1"]) == 0
    assert "LOCAL_RANK" not in os.environ, "a set LOCAL_RANK makes Lightning wait for processes nobody starts"
    assert lightning_mgpu.parse_local_rank(["train.py", "--local-rank=1"]) == 1
    assert os.environ["LOCAL_RANK"] == "1"
