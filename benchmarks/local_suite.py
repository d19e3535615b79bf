"""Single-process variants, each a fresh run on the same model, data and optimizer, repeated in turn (A B C A B C).

``single``: one device (CPU: one intra-op thread); ``single_2t`` (CPU): two intra-op threads; ``mixin``: ``single``
with ``MGPUMixin``; ``mgpu_dp``: one replica per device (CPU: 2 virtual replicas); ``raw``, ``raw_engine``,
``torch_dp`` (CUDA): a hand-written loop on one device, through ``MGPUDataParallel``, through
``torch.nn.DataParallel``. Every variant processes the same global batch per step.
"""

from __future__ import annotations

import itertools
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks import models
from benchmarks.modules import BenchModule, MixinBenchModule, StepTimer, mgpu_dp_trainer, quiet_lightning, trainer_for
from benchmarks.phases import PHASES, PhaseTimer
from lightning_mgpu import MGPUMixin
from lightning_mgpu.engine import MGPUDataParallel

CPU_VARIANTS = ("single", "single_2t", "mixin", "mgpu_dp", "raw", "raw_engine")
CUDA_VARIANTS = ("single", "mixin", "mgpu_dp", "raw", "raw_engine", "torch_dp")


def replica_devices(device: str) -> list[torch.device]:
    """2 virtual CPU replicas, every visible GPU, or with one GPU 2 replicas sharing it (one would split nothing)."""
    if device == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", index) for index in range(count)] if count > 1 else [torch.device("cuda", 0)] * 2
    return [torch.device("cpu")] * 2


def run_suite(mode: models.Mode, device: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Every variant on every model, ``mode.local_repeats`` times, alternating; returns the measurements."""
    quiet_lightning()
    variants = CUDA_VARIANTS if device == "cuda" else CPU_VARIANTS
    devices = replica_devices(device)
    measurements: dict[str, dict[str, list[dict[str, float]]]] = {spec.name: {} for spec in mode.models}
    for repeat in range(mode.local_repeats):
        started = time.perf_counter()
        for spec in mode.models:
            for variant in variants:
                run = _hand_written if variant in ("raw", "raw_engine", "torch_dp") else _lightning
                with models.intra_op_threads(device, 2 if variant == "single_2t" else 1):
                    measurements[spec.name].setdefault(variant, []).append(run(variant, spec, devices))
        say(f"  single-process repeat {repeat + 1}/{mode.local_repeats} ({time.perf_counter() - started:.1f} s)")
    return {"measurements": measurements, "replicas": len(devices)}


def _lightning(variant: str, spec: models.ModelSpec, devices: list[torch.device]) -> dict[str, float]:
    module = MixinBenchModule(spec) if variant == "mixin" else BenchModule(spec)
    timer = StepTimer(spec.warmup, spec.steps)
    gpu = devices[0].type == "cuda"
    steps = spec.warmup + spec.steps
    if variant == "mgpu_dp":
        trainer = mgpu_dp_trainer([timer], steps, devices)
    else:
        trainer = trainer_for([timer], steps, "auto", [0] if gpu else 1, "gpu" if gpu else "cpu")
    batch = spec.batch * len(devices)
    trainer.fit(module, DataLoader(models.dataset(spec, batch * steps), batch_size=batch, shuffle=False))
    durations = timer.durations()
    result = _summary(durations, batch, gpu)
    result["cpu_step_s"] = statistics.median(timer.durations(column=1))
    if variant == "mgpu_dp":
        compute = module.clock.critical_path(timer.first, timer.last)
        result.update(_split(timer.phase_durations(), compute, timer.strategy_step_seconds, durations))
    return result


def _hand_written(variant: str, spec: models.ModelSpec, devices: list[torch.device]) -> dict[str, float]:
    root, cuda = devices[0], devices[0].type == "cuda"
    clock = models.ReplicaClock()
    net = models.build_net(spec).to(root)
    model: torch.nn.Module = models.Clocked(net, clock)
    if variant == "raw_engine":
        model = MGPUDataParallel(model, devices)
    elif (
        variant == "torch_dp"
    ):  # it cannot repeat a GPU (its broadcast needs distinct devices): on one GPU it runs alone
        model = torch.nn.DataParallel(model, device_ids=sorted({device.index for device in devices}))
    phases = PhaseTimer(model).start() if isinstance(model, MGPUDataParallel) else None
    optim = models.optimizer(net.parameters())
    batch, steps = spec.batch * len(devices), spec.warmup + spec.steps
    marks: list[tuple[float, dict[str, float]]] = []
    try:
        for index, (x, y) in enumerate(
            DataLoader(models.dataset(spec, batch * steps), batch_size=batch, shuffle=False)
        ):
            if index >= spec.warmup:
                if cuda and index == spec.warmup:
                    torch.cuda.synchronize()
                marks.append((time.perf_counter(), {} if phases is None else dict(phases.seconds)))
            clock.step = index
            loss = torch.nn.functional.cross_entropy(
                model(x.to(root, non_blocking=True)), y.to(root, non_blocking=True)
            )
            optim.zero_grad()
            loss.backward()
            optim.step()
        if cuda:
            torch.cuda.synchronize()
        marks.append((time.perf_counter(), {} if phases is None else dict(phases.seconds)))
    finally:
        if phases is not None:
            phases.stop()
        if isinstance(model, MGPUDataParallel):
            model.close()
    durations = [end[0] - start[0] for start, end in itertools.pairwise(marks)]
    result = _summary(durations, batch, cuda)
    if phases is not None:
        split = {name: [end[1][name] - start[1][name] for start, end in itertools.pairwise(marks)] for name in PHASES}
        engine = [sum(parts) for parts in zip(*split.values(), strict=True)]
        result.update(_split(split, clock.critical_path(spec.warmup, steps - 1), engine, durations))
    return result


def _summary(durations: list[float], batch: int, cuda: bool) -> dict[str, float]:
    step = models.typical_step(durations, cuda)
    return {"step_s": step, "samples_per_s": batch / step}


def _split(
    phases: dict[str, list[float]], compute: list[float], engine: list[float], durations: list[float]
) -> dict[str, float]:
    """Medians over steps of each part of an engine step, and of its overhead share.

    ``engine``: per step, all the data-parallel layer did (``mgpu_dp``: the strategy's ``training_step``; the bare
    engine: its five phases); ``compute``: the slowest replica's step body. Overhead is the difference, its share
    taken step by step (overhead / that step's duration).
    """
    if len(engine) != len(durations):
        raise RuntimeError(f"timed {len(durations)} steps but {len(engine)} calls of the data-parallel step")
    known = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    parts = {
        "scatter_s": phases["scatter"],
        "replicate_s": phases["replicate"],
        "dispatch_s": [a - c for a, c in zip(phases["parallel_apply"], compute, strict=True)],
        "compute_s": compute,
        "settle_s": phases["settle"],
        "gather_s": phases["gather"],
        "glue_s": [e - k for e, k in zip(engine, known, strict=True)],
        "overhead_s": [e - c for e, c in zip(engine, compute, strict=True)],
    }
    result = {name: statistics.median(values) for name, values in parts.items()}
    result["overhead_share"] = statistics.median(
        (e - c) / d for e, c, d in zip(engine, compute, durations, strict=True)
    )
    return result


class _Plain(L.LightningModule):
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


class _WithMixin(MGPUMixin, _Plain):
    pass


def mixin_wrapper_us(repeats: int, loops: int = 2000) -> float:
    """Microseconds per call that ``MGPUMixin``'s wrapper adds to a step method (median over alternating loops)."""
    plain, mixed, loss = _Plain(), _WithMixin(), torch.tensor(1.5)
    steps = [lambda module=module: module.training_step(loss, 0) for module in (plain, mixed)]
    costs = [[timeit.timeit(step, number=loops) / loops * 1e6 for step in steps] for _ in range(max(3, repeats))]
    return statistics.median(with_mixin - without for without, with_mixin in costs)
