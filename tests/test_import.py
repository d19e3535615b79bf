"""What ``import lightning_mgpu`` does to a process: it imports no second Lightning namespace and touches no logger.

Importing ``pytorch_lightning`` rebinds the rank-zero logger that ``lightning.pytorch`` shares with it, so a process
that quiets ``lightning.pytorch``'s logger would hear Lightning again. Each test starts a fresh interpreter: this one
has imported both namespaces long ago.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import clean_env

TIMEOUT = 180

_MODEL = """
import torch
from torch.utils.data import DataLoader, TensorDataset

def fit(pl, strategy, devices):
    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
    )
    trainer.fit(Tiny(), data)
    strategy = type(trainer.strategy)
    print("fitted", type(trainer).__module__, f"{strategy.__module__}.{strategy.__name__}", trainer.global_step)
    return trainer
"""
"""A function ``fit(pl, strategy, devices)`` that trains a tiny module of the namespace ``pl`` for one epoch."""

_LIGHTNING_INFO = ("GPU available", "TPU available", "HPU available", "max_epochs", "Trainer.fit")
"""Words of the lines Lightning logs at info level when a Trainer is built and when ``fit`` ends."""


_BOUND = "lightning_mgpu.strategies.pytorch_lightning"
"""The module of the strategies bound to ``pytorch_lightning``."""


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (after the tiny model's definition) in a fresh interpreter; stdout and stderr together."""
    program = _MODEL + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stdout
    return result


@pytest.mark.slow
def test_importing_the_package_imports_no_second_namespace(tmp_path: Path) -> None:
    result = _python(
        """
        import sys
        import lightning as L
        import lightning_mgpu
        L.Trainer(strategy="mgpu_dp", accelerator="cpu", devices=2, logger=False)
        print("imported", sorted(name for name in ("pytorch_lightning", "lightning_fabric") if name in sys.modules))
        """,
        tmp_path,
    )
    assert "imported []" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("mgpu_dp", 2), ("mgpu_ddp", 1), ("auto", 1)],
    ids=["mgpu_dp", "mgpu_ddp", "lightning-default"],
)
def test_quieting_lightning_pytorch_s_logger_quiets_lightning(tmp_path: Path, strategy: str, devices: int) -> None:
    result = _python(
        f"""
        import logging
        import lightning as L
        import lightning_mgpu
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        fit(L, {strategy!r}, {devices})
        """,
        tmp_path,
    )
    assert "fitted lightning.pytorch.trainer.trainer " in result.stdout
    heard = [line for line in result.stdout.splitlines() if any(words in line for words in _LIGHTNING_INFO)]
    assert not heard, result.stdout


@pytest.mark.slow
def test_pytorch_lightning_imported_after_the_package_gets_the_strategies(tmp_path: Path) -> None:
    result = _python(
        """
        import sys
        import lightning
        finders = list(sys.meta_path)
        import lightning_mgpu
        import pytorch_lightning as pl
        assert "mgpu_ddp" in pl.strategies.StrategyRegistry, pl.strategies.StrategyRegistry.available_strategies()
        assert sys.meta_path == finders, sys.meta_path  # the hook is gone once it has run
        fit(pl, "mgpu_dp", 2)
        trainer = fit(pl, lightning_mgpu.MGPUDPStrategy(), 2)  # the public class, bound while pl was not imported
        assert isinstance(trainer.strategy, lightning_mgpu.MGPUDPStrategy)
        import importlib
        importlib.reload(pl)
        fit(pl, "mgpu_ddp", 1)
        """,
        tmp_path,
    )
    fitted = [line for line in result.stdout.splitlines() if line.startswith("fitted")]
    assert fitted == [
        f"fitted pytorch_lightning.trainer.trainer {_BOUND}.MGPUDPStrategy 2",
        f"fitted pytorch_lightning.trainer.trainer {_BOUND}.MGPUDPStrategy 2",
        f"fitted pytorch_lightning.trainer.trainer {_BOUND}.MGPUDDPStrategy 2",
    ]


@pytest.mark.slow
def test_pytorch_lightning_imported_before_the_package_gets_the_strategies(tmp_path: Path) -> None:
    result = _python(
        """
        import sys
        import pytorch_lightning as pl
        finders = list(sys.meta_path)
        import lightning_mgpu
        assert "mgpu_ddp" in pl.strategies.StrategyRegistry, pl.strategies.StrategyRegistry.available_strategies()
        assert sys.meta_path == finders, sys.meta_path  # nothing left waiting for an import
        fit(pl, "mgpu_dp", 2)
        trainer = fit(pl, lightning_mgpu.MGPUDPStrategy(), 2)
        assert isinstance(trainer.strategy, lightning_mgpu.MGPUDPStrategy)
        """,
        tmp_path,
    )
    fitted = [line for line in result.stdout.splitlines() if line.startswith("fitted")]
    assert fitted == [f"fitted pytorch_lightning.trainer.trainer {_BOUND}.MGPUDPStrategy 2"] * 2


@pytest.mark.slow
def test_the_pytorch_lightning_bindings_imported_first_register_themselves(tmp_path: Path) -> None:
    result = _python(
        """
        import lightning_mgpu.strategies.pytorch_lightning as bound  # as unpickling a strategy in a spawned process
        import pytorch_lightning as pl
        assert pl.strategies.StrategyRegistry["mgpu_dp"]["strategy"] is bound.MGPUDPStrategy
        fit(pl, "mgpu_ddp", 1)
        """,
        tmp_path,
    )
    assert f"fitted pytorch_lightning.trainer.trainer {_BOUND}.MGPUDDPStrategy 2" in result.stdout


@pytest.mark.slow
def test_importing_the_package_changes_no_logger_and_no_warning_filter(tmp_path: Path) -> None:
    result = _python(
        """
        import logging
        import warnings
        import lightning

        def state():
            loggers = {
                name: (logger.level, logger.propagate, list(logger.handlers), list(logger.filters), logger.disabled)
                for name, logger in logging.root.manager.loggerDict.items()
                if name.startswith(("lightning", "pytorch_lightning")) and isinstance(logger, logging.Logger)
            }
            root = (logging.root.level, list(logging.root.handlers))
            return loggers, root, list(warnings.filters)

        before = state()
        import lightning_mgpu
        after = state()
        assert after == before, (before, after)
        print("unchanged")
        """,
        tmp_path,
    )
    assert "unchanged" in result.stdout
