"""Single-process benchmarks: ``mgpu_dp`` and its engine against one device, and ``MGPUMixin`` against no mixin.

Variants, each a fresh run on the same model (same seed), data and optimizer, timed over the same steps:

- ``single``: Lightning's default strategy on one device (on the CPU: one intra-op thread);
- ``single_2t`` (CPU only): the same with two intra-op threads, torch's own way of using both cores;
- ``mixin``: ``single`` with ``MGPUMixin`` among the LightningModule's bases;
- ``mgpu_dp``: ``strategy="mgpu_dp"`` with one replica per device (on the CPU: 2 virtual replicas, one intra-op
  thread each);
- ``raw``: a hand-written loop on one device, no Lightning;
- ``raw_engine``: the same loop through ``lightning_mgpu.engine.MGPUDataParallel`` (the engine without Lightning);
- ``torch_dp`` (CUDA only): the same loop through ``torch.nn.DataParallel``.

Every variant processes the same global batch per step (the per-device batch times the number of replicas), so step
times compare equal work. Repeats run the variants in turn (A B C A B C ...).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.models import Clocked, Mode, ModelSpec, ReplicaClock, build_net, dataset, optimizer, typical_step
from benchmarks.modules import BenchModule, MixinBenchModule, StepTimer, quiet_lightning, trainer_for
from benchmarks.phases import PHASES, PhaseTimer
from lightning_mgpu import MGPUDPStrategy
from lightning_mgpu.engine import MGPUDataParallel

CPU_VARIANTS = ("single", "single_2t", "mixin", "mgpu_dp", "raw", "raw_engine")
CUDA_VARIANTS = ("single", "mixin", "mgpu_dp", "raw", "raw_engine", "torch_dp")


def replica_devices(device: str) -> list[torch.device]:
    """The devices of the data-parallel variants: 2 virtual CPU replicas, every visible GPU, or 2 replicas on one GPU.

    With a single GPU, one device would leave nothing to split (``mgpu_dp`` with one device runs the module itself),
    so its two replicas share the GPU, as the CPU proxy's share the CPU.
    """
    if device == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", index) for index in range(count)] if count > 1 else [torch.device("cuda", 0)] * 2
    return [torch.device("cpu"), torch.device("cpu")]


def run_suite(mode: Mode, device: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Every variant on every model, ``mode.local_repeats`` times, alternating; returns the measurements."""
    quiet_lightning()
    variants = CUDA_VARIANTS if device == "cuda" else CPU_VARIANTS
    devices = replica_devices(device)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    measurements: dict[str, dict[str, list[dict[str, float]]]] = {spec.name: {} for spec in mode.models}
    try:
        for repeat in range(mode.local_repeats):
            started = time.perf_counter()
            for spec in mode.models:
                for variant in variants:
                    measurements[spec.name].setdefault(variant, []).append(measure(variant, spec, devices))
            say(f"  single-process repeat {repeat + 1}/{mode.local_repeats} ({time.perf_counter() - started:.1f} s)")
    finally:
        torch.set_num_threads(threads)
    return {"measurements": measurements, "replicas": len(devices), "variants": list(variants)}


def measure(variant: str, spec: ModelSpec, devices: list[torch.device]) -> dict[str, float]:
    """One run of ``variant``: seconds per step, and for the engines the split of the step into phases."""
    if variant == "single_2t":
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            return _lightning(variant, spec, devices)
        finally:
            torch.set_num_threads(previous)
    if variant in ("raw", "raw_engine", "torch_dp"):
        return _hand_written(variant, spec, devices)
    return _lightning(variant, spec, devices)


def _global_batch(spec: ModelSpec, devices: list[torch.device]) -> int:
    return spec.batch * len(devices)


def _lightning(variant: str, spec: ModelSpec, devices: list[torch.device]) -> dict[str, float]:
    module = MixinBenchModule(spec) if variant == "mixin" else BenchModule(spec)
    timer = StepTimer(spec.warmup, spec.steps)
    accelerator = "gpu" if devices[0].type == "cuda" else "cpu"
    strategy: str | MGPUDPStrategy = "mgpu_dp" if variant == "mgpu_dp" else "auto"
    trainer_devices: int | list[int] = len(devices) if variant == "mgpu_dp" else [0] if accelerator == "gpu" else 1
    if variant == "mgpu_dp" and accelerator == "gpu" and len(set(devices)) < len(devices):
        # Lightning refuses a repeated GPU list; the strategy's own devices are kept as they are.
        strategy, trainer_devices = MGPUDPStrategy(parallel_devices=devices), [0]
    steps = spec.warmup + spec.steps
    trainer = trainer_for(timer, steps, strategy, trainer_devices, accelerator)
    batch = _global_batch(spec, devices)
    trainer.fit(module, DataLoader(dataset(spec, batch * steps), batch_size=batch, shuffle=False))
    durations = timer.durations()
    result = _summary(durations, batch, accelerator == "gpu")
    result["cpu_step_s"] = statistics.median(timer.cpu_durations())
    if variant == "mgpu_dp":
        compute = module.clock.critical_path(timer.first, timer.last)
        result.update(_split(timer.phase_durations(), compute, timer.strategy_step_seconds, durations))
    return result


def _hand_written(variant: str, spec: ModelSpec, devices: list[torch.device]) -> dict[str, float]:
    root = devices[0]
    clock = ReplicaClock()
    net = build_net(spec).to(root)
    model: torch.nn.Module = Clocked(net, clock)
    if variant == "raw_engine":
        model = MGPUDataParallel(model, devices)
    elif variant == "torch_dp":
        # torch's DataParallel cannot repeat a GPU (its broadcast needs distinct devices): on one GPU it runs alone.
        model = torch.nn.DataParallel(model, device_ids=sorted({device.index for device in devices}))
    optim = optimizer(net.parameters())
    batch = _global_batch(spec, devices)
    steps = spec.warmup + spec.steps
    loader = DataLoader(dataset(spec, batch * steps), batch_size=batch, shuffle=False)
    cuda = root.type == "cuda"
    marks: list[float] = []
    phase_marks: list[dict[str, float]] = []
    timer = PhaseTimer(model).start() if isinstance(model, MGPUDataParallel) else None
    try:
        for index, (x, y) in enumerate(loader):
            if index == spec.warmup:
                _synchronize(cuda)
            if index >= spec.warmup:
                phase_marks.append({} if timer is None else dict(timer.seconds))
                marks.append(time.perf_counter())
            clock.step = index
            x, y = x.to(root, non_blocking=True), y.to(root, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            if index == steps - 1:
                break
        _synchronize(cuda)
        phase_marks.append({} if timer is None else dict(timer.seconds))
        marks.append(time.perf_counter())
    finally:
        if timer is not None:
            timer.stop()
        if isinstance(model, MGPUDataParallel):
            model.close()
    durations = [end - start for start, end in itertools.pairwise(marks)]
    result = _summary(durations, batch, cuda)
    if isinstance(model, MGPUDataParallel):
        phases = {name: [end[name] - start[name] for start, end in itertools.pairwise(phase_marks)] for name in PHASES}
        compute = clock.critical_path(spec.warmup, steps - 1)
        engine = [sum(parts) for parts in zip(*phases.values(), strict=True)]
        result.update(_split(phases, compute, engine, durations))
    return result


def _summary(durations: list[float], batch: int, cuda: bool) -> dict[str, float]:
    step = typical_step(durations, cuda)
    return {"step_s": step, "samples_per_s": batch / step, "mean_step_s": statistics.fmean(durations)}


def _split(
    phases: dict[str, list[float]], compute: list[float], engine: list[float], durations: list[float]
) -> dict[str, float]:
    """Per-step seconds of each part of the engine's work (medians over steps), and its overhead share.

    ``engine`` holds, per step, everything the data-parallel layer did (under ``mgpu_dp``: the strategy's whole
    ``training_step``; for the bare engine: its four phases). ``compute`` holds the replicas' own work on the
    critical path (per step, the slowest replica's step body, timed inside its thread). Overhead is the difference;
    its share is taken step by step (overhead of a step / duration of that step) and summarized by the median.
    """
    if len(engine) != len(durations):
        raise RuntimeError(f"timed {len(durations)} steps but {len(engine)} calls of the data-parallel step")
    zero = [0.0] * len(durations)
    apply = phases.get("parallel_apply", zero)
    known = [sum(parts) for parts in zip(*phases.values(), strict=True)] if phases else zero
    parts = {
        "scatter_s": phases.get("scatter", zero),
        "replicate_s": phases.get("replicate", zero),
        "dispatch_s": [a - c for a, c in zip(apply, compute, strict=True)],
        "compute_s": compute,
        "gather_s": phases.get("gather", zero),
        "glue_s": [e - k for e, k in zip(engine, known, strict=True)],
        "overhead_s": [e - c for e, c in zip(engine, compute, strict=True)],
    }
    result = {name: statistics.median(values) for name, values in parts.items()}
    result["overhead_share"] = statistics.median(
        (e - c) / d for e, c, d in zip(engine, compute, durations, strict=True)
    )
    return result


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
