"""Register the strategy names with Lightning on import, without relying on Lightning core to do it."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.strategies import DataParallelStrategy, DDPStrategy

STRATEGIES = (DataParallelStrategy, DDPStrategy)


def register_all() -> None:
    """Register ``mgpu_dp`` and ``mgpu_ddp``; safe to call any number of times, reloads included."""
    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)
