"""Profiles of the timed training steps: ``mgpu_dp`` under ``torch.profiler``, ``mgpu_ddp`` under cProfile.

``mgpu_dp`` runs its replicas in the engine's own threads. ``torch.profiler`` records every thread when asked to
(``profile_all_threads``, in torch's experimental config), so the replica threads' work lands in one profile without
any per-thread profiler of our own; on a torch without that option only the calling thread is recorded, and the
summary says so. The engine carries no profiler calls of its own (a ``record_function`` costs about a microsecond
even with no profiler running): for the profiled fit only, ``labelled`` wraps the engine's and the strategy's
functions in ``record_function`` labels, and puts them back afterwards. The profiler slows every torch call down a
little, so shares overstate the engine somewhat; the unprofiled phase split in ``results.json`` gives the real
proportions.

``mgpu_ddp`` does all its work on the main thread; ``ProfileSteps`` profiles that thread with cProfile (one profiler
at a time, which Python 3.12's cProfile requires).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
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
from benchmarks.modules import BenchModule, StepTimer, quiet_lightning, trainer_for

PACKAGE_MARK = f"{os.sep}lightning_mgpu{os.sep}"
KEY_FUNCTIONS = (
    ("strategies/ddp.py", "training_step"),
    ("step/health.py", "check_loss"),
    ("resume.py", "__iter__"),
)
LABELS = (
    ("lightning_mgpu.strategies.dp", "MGPUDPStrategy._parallel_step", "mgpu::strategy_step"),
    ("lightning_mgpu.engine.data_parallel", "scatter_to_devices", "mgpu::scatter"),
    ("lightning_mgpu.engine.replicate", "ReplicaCache.__call__", "mgpu::replicate"),
    ("lightning_mgpu.step.replicas", "prepare_replica", "mgpu::prepare_replica"),
    ("lightning_mgpu.engine.data_parallel", "MGPUDataParallel._synchronise_batchnorms", "mgpu::batchnorm_setup"),
    ("lightning_mgpu.engine.parallel_apply", "ParallelApply.__call__", "mgpu::parallel_apply"),
    ("lightning_mgpu.engine.parallel_apply", "_Job.run", "mgpu::replica_thread"),
    ("benchmarks.modules", "BenchModule.training_step", "mgpu::replica_step_body"),
    ("lightning_mgpu.engine.replicate", "ReplicaCache.keep_reassigned_buffers", "mgpu::keep_buffers"),
    ("lightning_mgpu.step.replicas", "replay", "mgpu::log_replay"),
    ("lightning_mgpu.engine.data_parallel", "MGPUDataParallel.gather", "mgpu::gather"),
    ("lightning_mgpu.step.replicas", "_reduce_loss", "mgpu::reduce_loss"),
)
"""(module, attribute path, label): what ``labelled`` wraps for a profiled ``mgpu_dp`` run, in step order."""
Function = tuple[str, int, str]


@contextlib.contextmanager
def labelled(labels: tuple[tuple[str, str, str], ...] = LABELS) -> Iterator[None]:
    """Wrap each named function in a ``record_function`` label while the block runs; put the originals back after."""
    import importlib

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


class TorchProfileSteps(L.Callback):
    """Runs ``torch.profiler`` over the steps that ``timer`` times, every thread included where torch can."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.all_threads = True
        try:
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):  # a torch without the option records the calling thread only
            config, self.all_threads = None, False
        self.profiler = torch.profiler.profile(activities=[ProfilerActivity.CPU], experimental_config=config)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.first:
            self.profiler.start()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.last:
            self.profiler.stop()


def profile_mgpu_dp(
    spec: ModelSpec, devices: list[torch.device], out: Path | None, top: int = 12, trace: bool = False
) -> dict[str, Any]:
    """Profile ``spec.steps`` steps of ``mgpu_dp`` on ``devices``; with ``trace``, write a Chrome trace under ``out``.

    Returns per label (see ``LABELS``) its calls and microseconds per step and its share of the profiled steps'
    wall time, and the operators with the most self time (labels included).
    """
    quiet_lightning()
    module = BenchModule(spec)
    timer = StepTimer(spec.warmup, spec.steps)
    profiler = TorchProfileSteps(timer)
    accelerator = "gpu" if devices[0].type == "cuda" else "cpu"
    steps = spec.warmup + spec.steps
    trainer = trainer_for(timer, steps, "mgpu_dp", len(devices), accelerator, extra_callbacks=[profiler])
    batch = spec.batch * len(devices)
    with labelled():
        trainer.fit(module, DataLoader(dataset(spec, batch * steps), batch_size=batch, shuffle=False))
    if trace and out is not None:
        profiler.profiler.export_chrome_trace(str(out / f"profile-{spec.name}.trace.json"))
    averages = {event.key: event for event in profiler.profiler.key_averages()}
    wall_us = sum(timer.durations()) * 1e6

    def row(key: str) -> dict[str, Any]:
        event = averages.get(key)
        total = 0.0 if event is None else event.cpu_time_total
        return {
            "label": key,
            "calls_per_step": 0.0 if event is None else event.count / spec.steps,
            "us_per_step": total / spec.steps,
            "share_of_step": total / wall_us,
        }

    by_self = sorted(averages.values(), key=lambda event: event.self_cpu_time_total, reverse=True)[:top]
    return {
        "profiler": "torch.profiler",
        "profiled_step_ms": wall_us / spec.steps / 1e3,
        "steps": spec.steps,
        "replica_threads_profiled": profiler.all_threads,
        "labels": [row(label) for _, _, label in LABELS],
        "self_time": [
            {
                "label": event.key,
                "calls_per_step": event.count / spec.steps,
                "us_per_step": event.self_cpu_time_total / spec.steps,
                "share_of_step": event.self_cpu_time_total / wall_us,
            }
            for event in by_self
        ],
    }


class ProfileSteps(L.Callback):
    """Profiles the main thread with cProfile over the steps that ``timer`` times (``mgpu_ddp``'s benchmark).

    Put it after the ``StepTimer`` in the callbacks, so the timer's own work stays out of the profile.
    """

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.main = cProfile.Profile()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.first:
            self.main.enable()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.last:
            self.main.disable()

    def stats(self) -> pstats.Stats:
        """The statistics of the profiled steps."""
        return pstats.Stats(self.main)


def summarize(raw: dict[Function, Any], wall: float, steps: int, worker_threads: int, top: int) -> dict[str, Any]:
    """The package's functions by self time, the outside functions it calls by their time, and key cumulatives."""

    def row(function: Function, seconds: float, calls: int) -> dict[str, Any]:
        return {
            "function": _name(function),
            "calls_per_step": calls / steps,
            "us_per_step": seconds / steps * 1e6,
            "share_of_step": seconds / wall,
        }

    package = [(f, v) for f, v in raw.items() if _in_package(f)]
    self_time = sorted(package, key=lambda item: item[1][2], reverse=True)
    # Time of functions outside the package (torch, builtins) spent in calls made directly from package code.
    called: list[tuple[Function, float, int]] = []
    for function, (_, _, _, _, callers) in raw.items():
        if _in_package(function) or _is_wait(function):
            continue
        seconds = sum(edge[2] for caller, edge in callers.items() if _in_package(caller))
        calls = sum(edge[1] for caller, edge in callers.items() if _in_package(caller))
        if seconds:
            called.append((function, seconds, calls))
    called.sort(key=lambda item: item[1], reverse=True)
    cumulative = []
    for path, name in KEY_FUNCTIONS:
        for function, value in package:
            if function[2] == name and function[0].replace(os.sep, "/").endswith(path):
                cumulative.append(row(function, value[3], value[1]))
    overall = sorted(((f, v) for f, v in raw.items() if not _is_wait(f)), key=lambda item: item[1][2], reverse=True)
    return {
        "profiled_step_ms": wall / steps * 1e3,
        "steps": steps,
        "worker_threads_profiled": worker_threads,
        "package_self_time": [row(f, v[2], v[1]) for f, v in self_time[:top]],
        "package_self_time_total_share": sum(v[2] for _, v in package) / wall,
        "called_from_package": [row(f, seconds, calls) for f, seconds, calls in called[:top]],
        "called_from_package_total_share": sum(seconds for _, seconds, _ in called) / wall,
        "cumulative": cumulative,
        "overall_self_time": [row(f, v[2], v[1]) for f, v in overall[:top]],
    }


def _in_package(function: Function) -> bool:
    return PACKAGE_MARK in function[0]


def _is_wait(function: Function) -> bool:
    # Blocking waits (the main thread waiting for a lock or a queue) are not work.
    name = function[2]
    return any(
        mark in name
        for mark in ("method 'get' of '_queue.SimpleQueue'", "method 'acquire' of '_thread.lock'", "time.sleep")
    )


def _name(function: Function) -> str:
    filename, line, name = function
    if filename == "~":
        return name
    marker = filename.rfind(PACKAGE_MARK)
    if marker >= 0:
        short = "lightning_mgpu/" + filename[marker + len(PACKAGE_MARK) :].replace(os.sep, "/")
    else:
        parts = filename.replace(os.sep, "/").split("/")
        short = "/".join(parts[-3:]) if "site-packages" in filename else "/".join(parts[-2:])
    return f"{short}:{line}({name})"
