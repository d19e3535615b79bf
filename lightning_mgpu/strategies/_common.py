"""What the two lightning_mgpu strategies share: checks, step_end ownership, exact resume, registration."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader, Sampler

from lightning_mgpu._lightning_private import (
    metric_states,
    restore_metric_states,
    restore_training_results,
    training_results_state,
    with_sampler,
)
from lightning_mgpu.checks import check_devices_exist
from lightning_mgpu.hooks import claim_step_end, release_step_end
from lightning_mgpu.model_checks import check_model, report
from lightning_mgpu.strategies._resume import STATE_KEY, ResumableSampler, rng_states, set_rng_states


class MGPUStrategyMixin:
    """Put first among the bases of a Lightning ``ParallelStrategy`` subclass that sets ``strategy_name``."""

    strategy_name: str
    _parallel_devices: list[torch.device] | None
    _resumable: ResumableSampler | None = None
    _resume_state: dict[str, Any] | None = None
    _at_first_batch: dict[str, Any] | None = None

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
        claim_step_end(module)

    @staticmethod
    def _release_module(module: pl.LightningModule | None) -> None:
        """Hand ``*_step_end`` back to ``MGPUMixin``, so the module runs under any other strategy afterwards.

        Lightning's DDP strategy routes each step through the module's ``forward`` and, undoing that, leaves the
        class's own ``forward`` behind as an attribute of the module; that attribute is removed too.
        """
        if module is None:
            return
        release_step_end(module)
        forward = module.__dict__.get("forward")
        own_forward = getattr(type(module), "forward", None)
        if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is own_forward:
            del module.__dict__["forward"]

    def process_dataloader(self, dataloader: object) -> object:
        """Wrap the training sampler so a mid-epoch checkpoint can resume on exactly the remaining samples."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if not (isinstance(dataloader, DataLoader) and self._stage() == RunningStage.TRAINING):
            return dataloader
        sampler = dataloader.sampler
        if isinstance(sampler, ResumableSampler) or dataloader.batch_size is None or not isinstance(sampler, Sampler):
            return dataloader
        wrapped = with_sampler(dataloader, ResumableSampler(sampler))
        assert isinstance(wrapped.sampler, ResumableSampler)
        self._resumable = wrapped.sampler
        pending, self._resume_state = self._resume_state, None
        if pending is not None and pending["skip_batches"]:
            wrapped.sampler.resume(pending["sampler_seed"], skip=pending["skip_batches"] * dataloader.batch_size)
            self._at_first_batch = pending
        return wrapped

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add what exact resume needs, per rank: the epoch's sample order and progress, RNG states, epoch metrics.

        The epoch metrics are the logged values and the accumulated state of torchmetrics objects. Lightning calls
        this on every rank, so the ranks can pool their states here; rank 0 writes them.
        """
        skip_batches = self._batches_done_mid_epoch()
        trainer = self._trainer()
        mid_epoch = trainer if skip_batches and trainer is not None else None
        state = {
            "sampler_seed": self._resumable.epoch_seed if self._resumable is not None else None,
            "skip_batches": skip_batches,
            "rng": rng_states(),
            "results": training_results_state(mid_epoch) if mid_epoch else [],
            "metrics": metric_states(mid_epoch.lightning_module) if mid_epoch else {},
        }
        checkpoint[STATE_KEY] = {"ranks": _gather_objects(state)}
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """When resuming a fit, restore this rank's RNG states now and keep the rest for the training dataloader."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        ranks = checkpoint.get(STATE_KEY, {}).get("ranks")
        if ranks and self._fn() == TrainerFn.FITTING:
            rank = self.global_rank if len(ranks) == self.world_size else 0  # type: ignore[attr-defined]
            state = ranks[rank]
            set_rng_states(state["rng"])
            self._resume_state = state
        return checkpoint

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Mid-epoch resume: put the RNG and the epoch's logged aggregates back to where the interrupted run was.

        Creating the resumed epoch's data iterator drew from the RNG once more than that run had at this point.
        """
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        state, self._at_first_batch = self._at_first_batch, None
        trainer = self._trainer()
        if state is not None and trainer is not None:
            set_rng_states(state["rng"])
            restore_training_results(trainer, state["results"])
            restore_metric_states(trainer.lightning_module, state.get("metrics", {}))

    def _batches_done_mid_epoch(self) -> int:
        trainer = self._trainer()
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return 0
        # ``processed`` also counts the batch whose on_train_batch_end saved this checkpoint.
        done = getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0)
        return int(done) if 0 < done < trainer.num_training_batches else 0

    def _trainer(self) -> pl.Trainer | None:
        module = self.lightning_module  # type: ignore[attr-defined]
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    def _fn(self) -> TrainerFn | None:
        trainer = self._trainer()
        return trainer.state.fn if trainer is not None else None

    def _stage(self) -> RunningStage | None:
        trainer = self._trainer()
        return trainer.state.stage if trainer is not None else None


def _gather_objects(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order (just this one outside a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, state)
    return gathered
