"""What the two lightning_mgpu strategies share: device checks on assignment and idempotent registration."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mgpu.checks import check_devices_exist


class MGPUStrategyMixin:
    """Put first among the bases of a Lightning ``ParallelStrategy`` subclass that sets ``strategy_name``."""

    strategy_name: str
    _parallel_devices: list[torch.device] | None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of this node; checked when assigned, so a missing CUDA device fails before any step runs."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        if parallel_devices:
            check_devices_exist(parallel_devices, self.strategy_name)
        self._parallel_devices = parallel_devices

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` only (never Lightning's own names); registering again replaces the entry."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.__name__, override=True)
