"""torchmetrics' own Lightning integration tests, run under ``mgpu_dp`` on 2 CPU replicas.

``test_torchmetrics_lightning.py`` and ``torchmetrics_boring_model.py`` are torchmetrics' ``tests/integrations``
files (commit dab0333, release 1.9.0; Copyright The Lightning team, Apache License 2.0, headers kept), with only the
import of the boring model renamed. Every ``Trainer`` they build runs ``strategy="mgpu_dp", accelerator="cpu",
devices=2`` unless the test chooses the strategy or the devices itself, and the boring model's loaders give batches
of 2 rows (128 samples, so the number of batches stays 64), so that both replicas run every step: the metrics in
them are updated, called and logged inside the replicas.
"""

import os

import pytest
from copied_suites import batches_of_rows, default_trainers_to_mgpu_dp
from torchmetrics_boring_model import BoringModel, RandomDataset

import lightning_mgpu  # noqa: F401 - registers mgpu_dp

_ROWS = 2

_BUFFER = (
    "dp.md 'What replicas share': a buffer each replica changes from its own rows (self.sum += x.sum()) is refused"
    " with ReplicaStateError; the metrics themselves end as on one device"
)
# node id relative to this folder -> why the test differs under mgpu_dp, with the section of docs/dp.md stating it.
EXPECTED = {
    "test_torchmetrics_lightning.py::test_metric_lightning": _BUFFER,
    "test_torchmetrics_lightning.py::test_metric_collection_lightning_log": _BUFFER,
    "test_torchmetrics_lightning.py::test_scriptable": _BUFFER,
    "test_torchmetrics_lightning.py::test_metric_lightning_log": (
        "dp.md 'What replicas share': a 0-dim value appended to a list (self.sum.append(x.sum())) is read as the"
        " mean of the replica's rows, so the list holds the batch's mean, not its sum; the metrics end as on one"
        " device"
    ),
    "test_torchmetrics_lightning.py::test_metrics_reset": (
        "dp.md 'torchmetrics inside replicas': a mock put on a metric's reset is copied with the metric, so inside"
        " the step reset_mock() clears the replica's copy's mock, not the module's"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if os.path.dirname(str(item.path)) == here:
            reason = EXPECTED.get(f"{os.path.relpath(item.path, here)}::{item.name}")
            if reason is not None:
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.fixture(autouse=True)
def _mgpu_dp_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    default_trainers_to_mgpu_dp(monkeypatch)
    batches_of_rows(monkeypatch, BoringModel, RandomDataset, _ROWS)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that give no ``default_root_dir`` write into the working directory: make it ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
