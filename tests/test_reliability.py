"""Long runs stay flat in memory, threads and files; four replica threads log exactly what one device logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from models import loader, regression_data, trainer
from processes import clean_env, free_port
from torch import nn

from lightning_mgpu import MGPUMixin

SOAK = Path(__file__).parent / "scripts" / "soak.py"


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "steps"), [("mgpu_dp", 2000), ("mgpu_ddp", 500)])
def test_long_runs_keep_memory_threads_and_files_flat(strategy: str, steps: int) -> None:
    command = [sys.executable, str(SOAK), "--strategy", strategy, "--steps", str(steps)]
    env = clean_env(MASTER_PORT=str(free_port()))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    reports = _reports(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert len(reports) == (2 if strategy == "mgpu_ddp" else 1)
    for report in reports:
        assert report["steps"] == steps
        assert report["growth"]["rss_mb"] < 20.0
        assert report["growth"]["threads"] <= 0
        assert report["growth"]["files"] <= 0
        assert report["growth"]["tensors"] <= 0


def _reports(output: str) -> list[dict[str, Any]]:
    """Every rank's report in the output, wherever another process's output landed around it."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(output, match.start())[0] for match in re.finditer(r'\{"rank": ', output)]


class Busy(MGPUMixin, L.LightningModule):
    """Logs from replicas and from the *_step_end hooks, and updates torchmetrics there, every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.train_mse = torchmetrics.MeanSquaredError()
        self.val_mae = torchmetrics.MeanAbsoluteError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        prediction = self(x)
        self.log("chunk_mean_target", y.mean(), on_step=False, on_epoch=True)
        self.log("rows", float(x.shape[0]), reduce_fx="sum", on_step=False, on_epoch=True)
        return {"prediction": prediction.squeeze(1), "target": y.squeeze(1)}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = nn.functional.mse_loss(output["prediction"], output["target"])
        self.train_mse(output["prediction"].detach(), output["target"])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"prediction": self(x).squeeze(1), "target": y.squeeze(1)}

    def validation_step_end(self, output: dict[str, torch.Tensor]) -> None:
        self.val_mae(output["prediction"], output["target"])
        self.log("val_mae", self.val_mae)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_four_replica_threads_log_what_one_device_logs() -> None:
    runs = {}
    for name, overrides in {"one": {}, "four": {"devices": 4, "strategy": "mgpu_dp"}}.items():
        model = Busy()
        fitted = trainer(max_epochs=15, **overrides)
        fitted.fit(model, loader(regression_data(rows=60), 6), loader(regression_data(rows=21, seed=5), 7))
        runs[name] = (fitted.callback_metrics, {k: v.detach().clone() for k, v in model.state_dict().items()})
    (one_metrics, one_params), (four_metrics, four_params) = runs["one"], runs["four"]
    assert set(one_metrics) == set(four_metrics)
    for key, value in one_metrics.items():
        torch.testing.assert_close(four_metrics[key], value, atol=1e-6, rtol=0, msg=key)
    for key, value in one_params.items():
        torch.testing.assert_close(four_params[key], value, atol=1e-6, rtol=0, msg=key)
    assert four_metrics["rows"].item() == 60.0
