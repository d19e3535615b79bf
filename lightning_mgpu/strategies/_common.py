"""What the two lightning_mgpu strategies share: device and model checks, step_end ownership, registration."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mgpu.checks import check_devices_exist
from lightning_mgpu.hooks import CALLER_RUNS_STEP_END
from lightning_mgpu.model_checks import check_model, report


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

    def _prepare_module(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Check the model for multi-GPU traps before fitting, and take over calling its ``*_step_end`` hooks."""
        if trainer.state.fn == TrainerFn.FITTING:
            report(check_model(module), self.strategy_name)
        module.__dict__[CALLER_RUNS_STEP_END] = True

    @staticmethod
    def _release_module(module: pl.LightningModule | None) -> None:
        """Hand ``*_step_end`` back to ``MGPUMixin``, so the module runs under any other strategy afterwards."""
        if module is not None:
            module.__dict__.pop(CALLER_RUNS_STEP_END, None)
