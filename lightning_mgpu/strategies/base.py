"""What the two lightning_mgpu strategies share: device and model checks, exact resume, a module left as given."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mgpu._compat import drop_forward_left_by_lightning
from lightning_mgpu.checks import check_devices_exist, check_model, report
from lightning_mgpu.resume import ExactResume


class MGPUStrategyMixin(ExactResume):
    """Put first among the bases of a Lightning ``ParallelStrategy`` subclass that sets ``strategy_name``."""

    strategy_name: str

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of this node; checked when assigned, so a missing CUDA device fails before any step runs."""
        return super().parallel_devices  # type: ignore[misc]

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        if parallel_devices:
            check_devices_exist(parallel_devices, self.strategy_name)
        # Lightning's own property: the strategy's class, looked up past this mixin, gives it unbound.
        super(MGPUStrategyMixin, type(self)).parallel_devices.fset(self, parallel_devices)  # type: ignore[misc]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` only (never Lightning's own names); registering again replaces the entry."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.__name__, override=True)

    def _prepare_module(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Check the model for multi-GPU traps before fitting."""
        if trainer.state.fn == TrainerFn.FITTING:
            report(check_model(module), self.strategy_name)

    @staticmethod
    def _release_module(module: pl.LightningModule | None) -> None:
        """Leave the module as it was given, so it runs under any other strategy afterwards.

        Lightning's DDP strategy routes each step through the module's ``forward`` and, undoing that, leaves the
        class's own ``forward`` behind as an attribute of the module; that attribute is removed.
        """
        if module is not None:
            drop_forward_left_by_lightning(module)
