"""Profiles of the timed steps: ``mgpu_dp`` under ``torch.profiler``, ``mgpu_ddp`` under cProfile.

``mgpu_dp`` runs its replicas in the engine's threads, which ``torch.profiler`` records where torch offers
``profile_all_threads`` (elsewhere the summary says only the calling thread was). The engine carries no profiler
calls: for the profiled fit only, ``labelled`` wraps its parts in ``record_function`` labels and puts them back
after. ``mgpu_ddp`` does all its work on the main thread, which one cProfile profiles (Python 3.12 allows one
profiler at a time).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import importlib
import os
import pstats
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.profiler import ProfilerActivity, record_function
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks.models import ModelSpec, dataset
from benchmarks.modules import BenchModule, StepTimer, mgpu_dp_trainer, quiet_lightning

LABELS = (
    ("lightning_mgpu.strategies.dp", "MGPUDPLogic._parallel_step", "mgpu::strategy_step"),
    ("lightning_mgpu.engine.data_parallel", "scatter_to_devices", "mgpu::scatter"),
    ("lightning_mgpu.engine.replicate", "ReplicaCache.__call__", "mgpu::replicate"),
    ("lightning_mgpu.step.replicas", "prepare_replica", "mgpu::prepare_replica"),
    ("lightning_mgpu.engine.data_parallel", "MGPUDataParallel._batch_statistics_exchange", "mgpu::batchnorm_setup"),
    ("lightning_mgpu.engine.parallel_apply", "ParallelApply.__call__", "mgpu::parallel_apply"),
    ("lightning_mgpu.engine.parallel_apply", "_Job.run", "mgpu::replica_thread"),
    ("benchmarks.modules", "BenchModule.training_step", "mgpu::replica_step_body"),
    ("lightning_mgpu.engine.data_parallel", "MGPUDataParallel.settle", "mgpu::settle"),
    ("lightning_mgpu.step.replicas", "replay", "mgpu::log_replay"),
    ("lightning_mgpu.engine.data_parallel", "MGPUDataParallel.gather", "mgpu::gather"),
    ("lightning_mgpu.step.replicas", "combine_scalars", "mgpu::combine_scalars"),
)
"""(module, attribute path, label), in step order."""
PACKAGE_MARK = f"{os.sep}lightning_mgpu{os.sep}"


@contextlib.contextmanager
def labelled(labels: tuple[tuple[str, str, str], ...] = LABELS) -> Iterator[None]:
    """Wrap each function of ``labels`` (default ``LABELS``) in its ``record_function`` label while the block runs."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for module_name, path, label in labels:
            owner: Any = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = vars(owner)[name]
            saved.append((owner, name, original))
            setattr(owner, name, _with_label(original, label))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _with_label(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def labelled_call(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return function(*args, **kwargs)

    return labelled_call


class _Window(L.Callback):
    """Calls ``start`` before the first step ``timer`` times and ``stop`` after its last."""

    def __init__(self, timer: StepTimer, start: Callable[[], Any], stop: Callable[[], Any]) -> None:
        self.timer, self.start, self.stop = timer, start, stop

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.first:
            self.start()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.last:
            self.stop()


def every_thread_profiler() -> tuple[torch.profiler.profile, Any]:
    """A CPU ``torch.profiler`` that records every thread where torch offers it; the config is ``None`` elsewhere."""
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # a torch without the option records the calling thread only
        config = None
    return torch.profiler.profile(activities=[ProfilerActivity.CPU], experimental_config=config), config


def profile_row(name: str, seconds: float, calls: int, wall: float, steps: int) -> dict[str, Any]:
    """One profile entry per step: calls, microseconds, and share of the profiled wall time."""
    return {"name": name, "calls_per_step": calls / steps, "us_per_step": seconds / steps * 1e6,
            "share_of_step": seconds / wall}  # fmt: skip


def profile_mgpu_dp(spec: ModelSpec, devices: list[torch.device], out: Path, trace: bool) -> dict[str, Any]:
    """Profile ``spec.steps`` steps of ``mgpu_dp``: per label its time, and the most self time.

    With ``trace``, also writes ``out/profile-<model>.trace.json`` (for ``chrome://tracing`` or Perfetto).
    """
    quiet_lightning()
    profiler, config = every_thread_profiler()
    timer = StepTimer(spec.warmup, spec.steps)
    steps, batch = spec.warmup + spec.steps, spec.batch * len(devices)
    window = _Window(timer, profiler.start, profiler.stop)
    trainer = mgpu_dp_trainer([timer, window], steps, devices)
    with labelled():
        trainer.fit(BenchModule(spec), DataLoader(dataset(spec, batch * steps), batch_size=batch, shuffle=False))
    if trace:
        profiler.export_chrome_trace(str(out / f"profile-{spec.name}.trace.json"))
    wall = sum(timer.durations())
    return {
        "profiled_step_ms": wall / spec.steps * 1e3,
        "steps": spec.steps,
        "replica_threads_profiled": config is not None,
        **label_and_self_rows(profiler, LABELS, wall, spec.steps),
    }


def label_and_self_rows(
    profiler: torch.profiler.profile, labels: tuple[tuple[str, str, str], ...], wall: float, steps: int
) -> dict[str, list[dict[str, Any]]]:
    """Per label of ``labels``, its inclusive time and calls per step; and the 12 entries with the most self time."""
    events = {event.key: event for event in profiler.key_averages()}
    by_self = sorted(events.values(), key=lambda event: event.self_cpu_time_total, reverse=True)[:12]
    return {
        "labels": [
            profile_row(
                label,
                events[label].cpu_time_total * 1e-6 if label in events else 0.0,
                events[label].count if label in events else 0,
                wall,
                steps,
            )
            for _, _, label in labels
        ],  # fmt: skip
        "self_time": [profile_row(e.key, e.self_cpu_time_total * 1e-6, e.count, wall, steps) for e in by_self],
    }


class CProfileSteps(_Window):
    """cProfile of the main thread over the steps ``timer`` times; put it after the ``StepTimer`` in the callbacks."""

    def __init__(self, timer: StepTimer) -> None:
        self.profile = cProfile.Profile()
        super().__init__(timer, self.profile.enable, self.profile.disable)

    def summary(self, wall: float, steps: int, top: int = 10) -> dict[str, Any]:
        """The package's functions by self time, and the outside functions it calls by their time in those calls."""
        raw: dict[tuple[str, int, str], Any] = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
        package = sorted(((f, v) for f, v in raw.items() if PACKAGE_MARK in f[0]), key=lambda i: i[1][2], reverse=True)
        called = []  # (function, seconds, calls) spent in calls made directly from package code
        for function, (*_, callers) in raw.items():
            edges = [edge for caller, edge in callers.items() if PACKAGE_MARK in caller[0]]
            if PACKAGE_MARK not in function[0] and edges:
                called.append((function, sum(edge[2] for edge in edges), sum(edge[1] for edge in edges)))
        called.sort(key=lambda item: item[1], reverse=True)
        return {
            "profiled_step_ms": wall / steps * 1e3,
            "steps": steps,
            "package_self_share": sum(v[2] for _, v in package) / wall,
            "called_from_package_share": sum(seconds for _, seconds, _ in called) / wall,
            "package_self_time": [profile_row(_name(f), v[2], v[1], wall, steps) for f, v in package[:top]],
            "called_from_package": [profile_row(_name(f), s, c, wall, steps) for f, s, c in called[:top]],
        }


def _name(function: tuple[str, int, str]) -> str:
    filename, line, name = function
    if filename == "~":
        return name
    marker = filename.rfind(PACKAGE_MARK)
    if marker >= 0:
        filename = "lightning_mgpu" + filename[marker + len(PACKAGE_MARK) - 1 :]
    return f"{'/'.join(filename.replace(os.sep, '/').split('/')[-3:])}:{line}({name})"
