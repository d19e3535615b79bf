"""The benchmark LightningModules and the callback that times the training steps of a Lightning run."""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from benchmarks.models import ModelSpec, ReplicaClock, build_net, loss_of, optimizer
from benchmarks.phases import PhaseTimer
from lightning_mgpu import MGPUMixin
from lightning_mgpu.engine import MGPUDataParallel


class BenchModule(L.LightningModule):
    """The benchmark model as a LightningModule; it logs nothing, so only the loop and the strategy differ."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.net = build_net(spec)
        self.clock = ReplicaClock()

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        started = time.perf_counter()
        loss = loss_of(self.net, batch)
        self.clock.record(batch_idx, started)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters())


class MixinBenchModule(MGPUMixin, BenchModule):
    """The same model with ``MGPUMixin`` first among its bases, as the mixin's docstring asks."""


class StepTimer(L.Callback):
    """Times the steps ``warmup`` to ``warmup + steps - 1`` of a fit, each on its own, and the engine's parts.

    A step runs from ``on_train_batch_start`` (its batch already fetched) to the next step's start; the last one
    ends at its ``on_train_batch_end`` (after its optimizer step). On CUDA the first start and the last end
    synchronize the device. Under ``mgpu_dp`` the timer also times the engine's phases (``PhaseTimer``), snapshots
    them at every mark and times every call of the strategy's ``training_step`` (the replicas' step,
    gather and loss reduction, with the replica threads' work inside).
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.first = warmup
        self.last = warmup + steps - 1
        self.steps = steps
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.phase_marks: list[dict[str, float]] = []
        self.strategy_step_seconds: list[float] = []
        self._timing = False
        self._cuda = False
        self._phases: PhaseTimer | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._cuda = pl_module.device.type == "cuda"
        strategy = trainer.strategy
        if isinstance(strategy.model, MGPUDataParallel):
            self._phases = PhaseTimer(strategy.model).start()
            strategy.training_step = self._timed(strategy.training_step)  # type: ignore[method-assign]

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.__dict__.pop("training_step", None)
        if self._phases is not None:
            self._phases.stop()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.first <= batch_idx <= self.last:
            if batch_idx == self.first:
                self._synchronize()
                self._timing = True
            self._mark(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.last:
            self._synchronize()
            self._mark(trainer)
            self._timing = False

    def durations(self) -> list[float]:
        """Seconds of each timed step."""
        if len(self.marks) != self.steps + 1:
            raise RuntimeError("StepTimer: the run ended before the last timed step; raise max_steps or the data.")
        return [end - start for start, end in itertools.pairwise(self.marks)]

    def cpu_durations(self) -> list[float]:
        """CPU seconds of the main thread in each timed step: the work a step costs, whatever else the machine runs.

        Only meaningful where the main thread does all the work (one intra-op thread, no replica threads).
        """
        self.durations()
        return [end - start for start, end in itertools.pairwise(self.cpu_marks)]

    def phase_durations(self) -> dict[str, list[float]]:
        """Seconds per engine phase in each timed step (empty outside ``mgpu_dp``)."""
        if not self.phase_marks or not self.phase_marks[0]:
            return {}
        return {
            name: [end[name] - start[name] for start, end in itertools.pairwise(self.phase_marks)]
            for name in self.phase_marks[0]
        }

    def _mark(self, trainer: L.Trainer) -> None:
        self.phase_marks.append({} if self._phases is None else dict(self._phases.seconds))
        self.cpu_marks.append(time.thread_time())
        self.marks.append(time.perf_counter())

    def _timed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                if self._timing:
                    self.strategy_step_seconds.append(time.perf_counter() - started)

        return timed_step

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()


def quiet_lightning() -> None:
    """Silence Lightning's per-run banners and the warnings that every benchmark run would repeat."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*static graph.*")


def trainer_for(
    timer: L.Callback,
    steps: int,
    strategy: Any,
    devices: Any,
    accelerator: str,
    extra_callbacks: list[L.Callback] | None = None,
) -> L.Trainer:
    """A Trainer that runs exactly ``steps`` training steps and nothing else (no logger, checkpoints, validation)."""
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        max_steps=steps,
        limit_train_batches=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *(extra_callbacks or [])],
        default_root_dir=None,
    )
