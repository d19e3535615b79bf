"""torchmetrics' metrics across its test matrix, updated in a step, equal one device under mgpu_dp and mgpu_ddp.

47 metrics (classification: binary, multiclass, multilabel; regression; retrieval; aggregation; text; detection where
pycocotools and torchvision are installed) are updated in ``validation_step`` with what their documentation passes
(``tests/metric_matrix.py``), under ``mgpu_dp`` on 2 and 3 replicas and under ``mgpu_ddp`` on 2 gloo processes,
twice each, and computed at the epoch's end: every value equals one device's to 1e-6. Nine of them torchmetrics
cannot merge (Pearson, Kendall, concordance, min, max, BLEU, SacreBLEU, chrF, mean average precision); inside
``mgpu_dp``'s replicas the module's metric takes the whole batch once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from metric_matrix import METRICS, MetricMatrix, data
from processes import clean_env, free_port, run

import lightning_mgpu  # noqa: F401 - registers mgpu_dp

SCRIPT = Path(__file__).parent / "scripts" / "metrics_ddp.py"


def _validate(**settings: Any) -> dict[str, Any]:
    model = MetricMatrix()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, **settings
    )
    trainer.validate(model, data(), verbose=False)
    return model.results


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    return _validate(devices=1)


def _assert_same(results: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert results.keys() == expected.keys() == METRICS.keys()
    for name, value in expected.items():
        label = f"{where}, {name}"
        torch.testing.assert_close(
            results[name], value, atol=1e-6, rtol=1e-6, msg=lambda m, label=label: f"{label}: {m}"
        )


def test_the_matrix_holds_metrics_torchmetrics_cannot_merge_and_at_least_30() -> None:
    metrics = {name: make() for name, (make, _) in METRICS.items()}
    unmergeable = [name for name, metric in metrics.items() if metric.full_state_update is not False]
    assert len(metrics) >= 30
    assert {"pearson", "kendall", "concordance", "max", "min", "bleu", "chrf"} <= set(unmergeable)


@pytest.mark.parametrize("devices", [2, 3])
def test_metrics_updated_in_the_step_under_mgpu_dp_equal_one_device_twice(
    devices: int, one_device: dict[str, Any]
) -> None:
    for attempt in range(2):
        _assert_same(_validate(devices=devices, strategy="mgpu_dp"), one_device, f"{devices} replicas, run {attempt}")


@pytest.mark.slow
def test_metrics_updated_in_the_step_under_mgpu_ddp_equal_one_device_twice(
    tmp_path: Path, one_device: dict[str, Any]
) -> None:
    done = run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        clean_env(MASTER_PORT=str(free_port())),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for attempt in range(2):
        results = torch.load(tmp_path / f"run{attempt}.pt", weights_only=False)
        _assert_same(results, one_device, f"2 ranks, run {attempt}")
