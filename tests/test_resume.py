"""Kill a run with SIGKILL from outside, mid-epoch or after an epoch, resume it: nothing differs from a straight run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from models import StepEndRegressor, loader, regression_data, trainer
from processes import clean_env, free_port

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"


def _command(out: Path, strategy: str, every: int, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--out", str(out), "--strategy", strategy, "--every", str(every), *extra]


def _straight(out: Path, strategy: str, every: int) -> None:
    env = clean_env(MASTER_PORT=str(free_port()))
    result = subprocess.run(_command(out, strategy, every), env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def _kill_after(out: Path, strategy: str, every: int, checkpoint: str) -> Path:
    """Start the run, wait for ``checkpoint`` to be written, then SIGKILL every process of the run."""
    env = clean_env(MASTER_PORT=str(free_port()))
    process = subprocess.Popen(
        _command(out, strategy, every, "--sleep", "0.25"), env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    target = out / "checkpoints" / checkpoint
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.4)  # let the run go on past the checkpoint, so the kill lands mid-step
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert target.exists(), process.stderr.read() if process.stderr else ""
    assert process.returncode == -signal.SIGKILL
    assert not (out / "final.pt").exists(), "the run finished before it could be killed"
    return target


def _resume(out: Path, strategy: str, every: int, checkpoint: Path) -> None:
    env = clean_env(MASTER_PORT=str(free_port()))
    command = _command(out, strategy, every, "--ckpt-in", str(checkpoint))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def _final(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return torch.load(out / "final.pt", weights_only=False), json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mgpu_dp", "mgpu_ddp"])
@pytest.mark.parametrize(
    ("every", "checkpoint"), [(3, "step=13.ckpt"), (0, "step=10.ckpt")], ids=["mid-epoch", "epoch-end"]
)
def test_sigkill_and_resume_matches_a_straight_run(tmp_path: Path, strategy: str, every: int, checkpoint: str) -> None:
    every = 13 if every == 3 else every  # step 13 is in the middle of the second epoch (10 steps per epoch)
    _straight(tmp_path / "straight", strategy, every)
    saved = _kill_after(tmp_path / "killed", strategy, every, checkpoint)
    _resume(tmp_path / "resumed", strategy, every, saved)

    straight, straight_report = _final(tmp_path / "straight")
    resumed, resumed_report = _final(tmp_path / "resumed")
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0, msg=name)
    for index, state in straight["optimizer"]["state"].items():
        torch.testing.assert_close(
            resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"], atol=1e-6, rtol=0
        )
    resumed_losses = resumed_report["losses"]
    assert resumed_losses, "the resumed run trained"
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(straight_report["losses"][step], abs=1e-6), f"loss at step {step}"
    assert resumed_report["metrics"]["loss_epoch"] == pytest.approx(straight_report["metrics"]["loss_epoch"], abs=1e-6)


class _MetricLogged(StepEndRegressor):
    """Logs a torchmetrics object at epoch level from training_step_end, as 1.x DP code did."""

    def __init__(self) -> None:
        super().__init__()
        self.error_mean = torchmetrics.MeanMetric()
        self.largest = torchmetrics.MaxMetric()

    def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
        self.error_mean(step_output["errors"])
        self.largest(step_output["errors"])
        self.log("error_mean", self.error_mean, on_step=False, on_epoch=True)
        self.log("largest", self.largest, on_step=False, on_epoch=True)
        return step_output["errors"].mean()


@pytest.mark.parametrize("devices", [1, 2])
def test_torchmetrics_epoch_values_continue_after_a_mid_epoch_resume(tmp_path: Path, devices: int) -> None:
    def fit(ckpt_path: str | None = None, **overrides: Any) -> L.Trainer:
        run = trainer(tmp_path, max_epochs=1, devices=devices, strategy="mgpu_dp", **overrides)
        run.fit(_MetricLogged(), loader(regression_data(), 4), ckpt_path=ckpt_path)
        return run

    every_third = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    straight = fit(callbacks=[every_third], enable_checkpointing=True)
    resumed = fit(str(tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"))
    for name in ("error_mean", "largest"):
        torch.testing.assert_close(resumed.callback_metrics[name], straight.callback_metrics[name], atol=1e-6, rtol=0)
