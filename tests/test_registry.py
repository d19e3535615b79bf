"""Registration of the strategy names on import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mgpu
from lightning_mgpu import DataParallelStrategy


def test_import_registers_mgpu_dp() -> None:
    entry = StrategyRegistry["mgpu_dp"]
    assert entry["strategy"].__name__ == "DataParallelStrategy"
    assert entry["description"] == "DataParallelStrategy"


def test_importing_twice_and_reloading_is_harmless() -> None:
    importlib.reload(lightning_mgpu)
    importlib.reload(lightning_mgpu)
    lightning_mgpu.registry.register_all()
    assert StrategyRegistry.available_strategies().count("mgpu_dp") == 1
    assert isinstance(
        L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp", logger=False).strategy, DataParallelStrategy
    )


def test_a_fresh_interpreter_gets_the_name_from_the_import_alone() -> None:
    code = (
        "import lightning as L, lightning_mgpu;"
        "t = L.Trainer(accelerator='cpu', devices=3, strategy='mgpu_dp', logger=False);"
        "print(type(t.strategy).__name__, t.num_devices, t.world_size)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-3:] == ["DataParallelStrategy", "3", "1"]


@pytest.mark.parametrize("strategy", ["mgpu_dp", DataParallelStrategy()])
def test_trainer_accepts_the_name_and_an_instance(strategy: object) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.strategy.root_device.type == "cpu"
    assert trainer.strategy.num_replicas == 2
    assert not trainer.strategy.is_distributed
