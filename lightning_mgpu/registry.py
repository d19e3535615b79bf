"""Register the strategy names with Lightning on import, without relying on Lightning core to do it."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.strategies import DataParallelStrategy

STRATEGIES = (DataParallelStrategy,)


def register_all() -> None:
    """Register ``mgpu_dp`` (and future names); safe to call any number of times, reloads included."""
    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)
