"""The benchmark LightningModules, and the callback that times the training steps of a Lightning run."""

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
from lightning_mgpu import MGPUDPStrategy, MGPUMixin
from lightning_mgpu.engine import MGPUDataParallel


class BenchModule(L.LightningModule):
    """The benchmark model; it logs nothing, so only the loop and the strategy differ between variants."""

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
    """The same model with ``MGPUMixin`` first among its bases."""


class StepTimer(L.Callback):
    """Times steps ``warmup`` to ``warmup + steps - 1``: each from its ``on_train_batch_start`` to the next's.

    The last step ends at its ``on_train_batch_end``; on CUDA the first and last marks synchronize. Under ``mgpu_dp``
    it also times the engine's phases (``PhaseTimer``) and every call of the strategy's ``training_step``.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.first, self.last, self.steps = warmup, warmup + steps - 1, steps
        self.marks: list[tuple[float, float, dict[str, float]]] = []
        self.strategy_step_seconds: list[float] = []
        self._phases: PhaseTimer | None = None
        self._cuda = False

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
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.first <= idx <= self.last:
            self._mark(synchronize=idx == self.first)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if idx == self.last:
            self._mark(synchronize=True)

    def durations(self, column: int = 0) -> list[float]:
        """Wall seconds of each timed step; ``column=1``: the main thread's CPU seconds (``time.thread_time``)."""
        if len(self.marks) != self.steps + 1:
            raise RuntimeError("StepTimer: the run ended before the last timed step; raise max_steps or the data.")
        return [end[column] - start[column] for start, end in itertools.pairwise(self.marks)]

    def phase_durations(self) -> dict[str, list[float]]:
        """Seconds per engine phase in each timed step (empty outside ``mgpu_dp``)."""
        return {name: [end[2][name] - start[2][name] for start, end in itertools.pairwise(self.marks)]
                for name in self.marks[0][2]}  # fmt: skip

    def _mark(self, synchronize: bool) -> None:
        if synchronize and self._cuda:
            torch.cuda.synchronize()
        phases = {} if self._phases is None else dict(self._phases.seconds)
        self.marks.append((time.perf_counter(), time.thread_time(), phases))

    def _timed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                if self.marks and len(self.marks) <= self.steps:
                    self.strategy_step_seconds.append(time.perf_counter() - started)

        return timed_step


def quiet_lightning() -> None:
    """Silence Lightning's per-run banners and the warnings every benchmark run would repeat."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in ("does not have many workers", "GPU available but not used", "smaller than the logging interval",
                    "LeafSpec", "static graph"):  # fmt: skip
        warnings.filterwarnings("ignore", message=f".*{message}.*")


def mgpu_dp_trainer(callbacks: list[L.Callback], steps: int, devices: list[torch.device]) -> L.Trainer:
    """``trainer_for`` under ``mgpu_dp`` with one replica per entry of ``devices``.

    A repeated GPU (two replicas on a machine's only card), which Lightning's ``devices`` refuses, is given to the
    strategy itself, which keeps it.
    """
    if devices[0].type == "cuda" and len(set(devices)) < len(devices):
        return trainer_for(callbacks, steps, MGPUDPStrategy(parallel_devices=devices), [0], "gpu")
    return trainer_for(callbacks, steps, "mgpu_dp", len(devices), "gpu" if devices[0].type == "cuda" else "cpu")


def trainer_for(callbacks: list[L.Callback], steps: int, strategy: Any, devices: Any, accelerator: str) -> L.Trainer:
    """A Trainer that runs exactly ``steps`` training steps and nothing else (no logger, checkpoints, validation)."""
    return L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_epochs=1, max_steps=steps,
        limit_train_batches=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
