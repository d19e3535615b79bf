"""What the copied test suites (``tests/lightning_tests/``, ``tests/torchmetrics_tests/``) run under: ``mgpu_dp``.

Each suite's ``conftest.py`` calls these from its autouse fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

MGPU_DP = {"strategy": "mgpu_dp", "accelerator": "cpu", "devices": 2}


def default_trainers_to_mgpu_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``Trainer`` built runs ``MGPU_DP`` unless it chooses the strategy, the devices or another accelerator."""
    init = Trainer.__init__

    def __init__(self: Trainer, *args: object, **kwargs: object) -> None:  # noqa: N807
        if "strategy" not in kwargs and "devices" not in kwargs and kwargs.get("accelerator") in (None, "cpu", "auto"):
            kwargs = {**MGPU_DP, **kwargs, "accelerator": "cpu"}
        init(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", __init__)


def batches_of_rows(
    monkeypatch: pytest.MonkeyPatch, model: type[Any], dataset: Callable[[int, int], Any], rows: int
) -> None:
    """``model``'s loaders give batches of ``rows`` rows of ``dataset(32, 64 * rows)``: as many batches as before."""

    def loader(self: Any) -> DataLoader:
        return DataLoader(dataset(32, 64 * rows), batch_size=rows)

    for name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
        if hasattr(model, name):
            monkeypatch.setattr(model, name, loader)
