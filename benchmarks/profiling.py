"""cProfile of ``mgpu_dp`` training steps, the replica threads included.

cProfile profiles only the thread that enables it, and the replicas run in the engine's worker threads. So besides
the main thread's profiler, ``threading.setprofile`` installs a hook in every thread started during the fit (the
workers start at the first step); once timing begins, the hook gives each such thread its own ``cProfile.Profile``.
The per-thread statistics are merged, and each function's time is reported per step and as a share of the wall time
of the profiled steps. cProfile slows Python code down more than native code, so the shares overstate Python
overhead somewhat; the unprofiled phase split in ``results.json`` gives the real proportions.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks.models import ModelSpec, dataset
from benchmarks.modules import BenchModule, StepTimer, quiet_lightning, trainer_for

PACKAGE_MARK = f"{os.sep}lightning_mgpu{os.sep}"
KEY_FUNCTIONS = (
    ("strategies/_replica_step.py", "run_replica_step"),
    ("engine/data_parallel.py", "run"),
    ("engine/scatter.py", "scatter"),
    ("engine/replicate.py", "replicate"),
    ("strategies/_replica_step.py", "prepare_replica"),
    ("engine/parallel_apply.py", "__call__"),
    ("engine/parallel_apply.py", "_run_replica"),
    ("engine/parallel_apply.py", "enter"),
    ("engine/data_parallel.py", "gather"),
    ("strategies/_replica_log.py", "replay"),
    ("strategies/_replica_step.py", "_reduce_loss"),
)
Function = tuple[str, int, str]


class _ThreadProfiles:
    """Gives every thread that runs Python code while active its own profiler (see the module docstring)."""

    def __init__(self) -> None:
        self.active = False
        self.profiles: list[cProfile.Profile] = []
        self._local = threading.local()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        """``threading.setprofile`` hook: the first event in a thread while active starts that thread's profiler."""
        if self.active and getattr(self._local, "profile", None) is None:
            profile = cProfile.Profile()
            self._local.profile = profile
            self.profiles.append(profile)
            profile.enable()


class ProfileSteps(L.Callback):
    """Profiles the steps that ``timer`` times: the main thread, and with ``threads`` the threads started in the fit.

    Put it after the ``StepTimer`` in the callbacks, so the timer's own work stays out of the profile.
    """

    def __init__(self, timer: StepTimer, threads: _ThreadProfiles | None = None) -> None:
        self.timer = timer
        self.threads = threads or _ThreadProfiles()
        self.main = cProfile.Profile()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.first:
            self.threads.active = True
            self.main.enable()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.timer.last:
            self.main.disable()
            self.threads.active = False

    def stats(self) -> pstats.Stats:
        """The merged statistics of every profiled thread."""
        stats = pstats.Stats(self.main)
        for profile in self.threads.profiles:
            stats.add(profile)
        return stats


def profile_mgpu_dp(spec: ModelSpec, devices: list[torch.device], out: Path | None, top: int = 12) -> dict[str, Any]:
    """Profile ``spec.steps`` steps of ``mgpu_dp`` on ``devices``; write ``profile-<model>.pstats`` under ``out``."""
    quiet_lightning()
    module = BenchModule(spec)
    timer = StepTimer(spec.warmup, spec.steps)
    threads = _ThreadProfiles()
    profiler = ProfileSteps(timer, threads)
    accelerator = "gpu" if devices[0].type == "cuda" else "cpu"
    steps = spec.warmup + spec.steps
    trainer = trainer_for(timer, steps, "mgpu_dp", len(devices), accelerator, extra_callbacks=[profiler])
    batch = spec.batch * len(devices)
    threading.setprofile(threads.hook)
    try:
        trainer.fit(module, DataLoader(dataset(spec, batch * steps), batch_size=batch, shuffle=False))
    finally:
        threading.setprofile(None)
    time.sleep(0.05)  # let the stopped workers finish their last profiled call
    stats = profiler.stats()
    if out is not None:
        stats.dump_stats(str(out / f"profile-{spec.name}.pstats"))
    return summarize(stats.stats, sum(timer.durations()), spec.steps, len(threads.profiles), top)  # type: ignore[attr-defined]


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
    # Blocking waits (a worker idle on its queue, the main thread waiting for a future) are not work.
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
