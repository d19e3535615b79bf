"""The benchmark models, their synthetic data, and the settings of each mode (smoke, quick, full).

Two models bracket the cost of a framework layer: a small MLP, whose step is so cheap that per-step Python overhead
dominates, and a mid-size convolutional net whose step is dominated by compute. Both are built from a fixed seed and
trained on data generated from a seed, so every variant of a benchmark sees the same weights and the same rows.

Only ``torch`` is imported at module level: the hand-written PyTorch loops import this module without Lightning.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from typing_extensions import override

MODELS = ("mlp", "conv")
CLASSES = 10
LEARNING_RATE = 0.01
MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model's size and how many steps a measurement of it runs.

    Attributes:
        name: ``"mlp"`` or ``"conv"``.
        batch: rows per device: per process under DDP, per replica under ``mgpu_dp`` (whose global batch, also
            given to the single-device variant it is compared with, is ``batch`` times the number of replicas).
        warmup: steps run before timing starts (allocator, autograd and thread-pool warm-up, DDP's first buckets).
        steps: timed steps.
        width: hidden width of the MLP, or channels of the first convolution (doubled in the later ones).
        features: input features of the MLP, or the side of the conv net's square RGB images.
    """

    name: str
    batch: int
    warmup: int
    steps: int
    width: int
    features: int


@dataclasses.dataclass(frozen=True)
class Mode:
    """How long a run takes: model sizes, steps and repeats.

    Attributes:
        name: ``"smoke"``, ``"quick"`` or ``"full"``.
        models: one spec per benchmark model.
        ddp_repeats: repeats of the multi-process jobs (each job starts its processes anew).
        ddp_rounds: within one job, how many times the variants of that job run in turn (``torch``, ``ddp``,
            ``mgpu_ddp``, ``torch``, ``ddp``, ...); ``--isolated`` runs each variant as its own job instead.
        local_repeats: repeats of every single-process variant (run in the benchmark's own process).
        profile_steps: timed steps of the profiled run of ``mgpu_dp``, per model.
        overhead_loops: calls per timed loop of the engine-overhead benchmark (``benchmarks/overhead.py``).
        overhead_repeats: repeats of those loops, each variant of each case in turn.
    """

    name: str
    models: tuple[ModelSpec, ...]
    ddp_repeats: int
    ddp_rounds: int
    local_repeats: int
    profile_steps: int
    overhead_loops: int
    overhead_repeats: int


def _modes(device: str) -> dict[str, Mode]:
    # On a GPU the CPU-sized batches would leave the card idle, so each device gets a larger share of rows.
    scale = 8 if device == "cuda" else 1
    smoke = (
        ModelSpec("mlp", batch=8, warmup=1, steps=3, width=32, features=16),
        ModelSpec("conv", batch=4, warmup=1, steps=2, width=4, features=8),
    )
    quick = (
        ModelSpec("mlp", batch=64 * scale, warmup=20, steps=200, width=256, features=64),
        ModelSpec("conv", batch=32 * scale, warmup=3, steps=20, width=32, features=32),
    )
    full = (
        ModelSpec("mlp", batch=64 * scale, warmup=50, steps=400, width=256, features=64),
        ModelSpec("conv", batch=32 * scale, warmup=5, steps=40, width=32, features=32),
    )
    return {
        "smoke": Mode(
            "smoke",
            smoke,
            ddp_repeats=1,
            ddp_rounds=1,
            local_repeats=1,
            profile_steps=2,
            overhead_loops=2,
            overhead_repeats=1,
        ),
        "quick": Mode(
            "quick",
            quick,
            ddp_repeats=3,
            ddp_rounds=3,
            local_repeats=5,
            profile_steps=40,
            overhead_loops=20,
            overhead_repeats=41,
        ),
        "full": Mode(
            "full",
            full,
            ddp_repeats=5,
            ddp_rounds=3,
            local_repeats=9,
            profile_steps=100,
            overhead_loops=50,
            overhead_repeats=81,
        ),
    }


def mode_settings(name: str, device: str) -> Mode:
    """The settings of mode ``name`` (``smoke``, ``quick``, ``full``) on ``device`` (``cpu``, ``cuda``)."""
    return _modes(device)[name]


def spec_of(mode: Mode, model: str) -> ModelSpec:
    """The spec of ``model`` in ``mode``."""
    return next(spec for spec in mode.models if spec.name == model)


def build_net(spec: ModelSpec) -> nn.Module:
    """The bare ``nn.Module`` of ``spec``, with weights from a fixed seed (no BatchNorm: no buffers to sync)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        if spec.name == "mlp":
            return nn.Sequential(
                nn.Linear(spec.features, spec.width),
                nn.ReLU(),
                nn.Linear(spec.width, spec.width),
                nn.ReLU(),
                nn.Linear(spec.width, CLASSES),
            )
        width = spec.width
        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * width, CLASSES),
        )
    finally:
        torch.random.set_rng_state(generator_state)


def dataset(spec: ModelSpec, rows: int, seed: int = 0) -> TensorDataset:
    """``rows`` synthetic samples and class labels for ``spec``, the same on every process for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    if spec.name == "mlp":
        x = torch.randn(rows, spec.features, generator=generator)
    else:
        x = torch.randn(rows, 3, spec.features, spec.features, generator=generator)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return TensorDataset(x, y)


def optimizer(parameters: Any) -> torch.optim.Optimizer:
    """The optimizer every variant uses."""
    return torch.optim.SGD(parameters, lr=LEARNING_RATE, momentum=MOMENTUM)


def loss_of(net: nn.Module, batch: Any) -> torch.Tensor:
    """The loss every variant computes: cross entropy of ``net`` on one (chunk of a) batch."""
    x, y = batch
    return nn.functional.cross_entropy(net(x), y)


class ReplicaClock:
    """Records the wall time of every call of the step body, from whichever thread (replica) runs it.

    Replicas made by the ``mgpu_dp`` engine are shallow copies of the LightningModule, so they share this object
    with the original and their records land in one list. ``list.append`` is atomic under the GIL.
    """

    def __init__(self) -> None:
        self.records: list[tuple[int, float, float]] = []
        self.step = 0

    def record(self, batch_idx: int, started: float) -> None:
        """Record that the step body for ``batch_idx`` started at ``started`` and ends now."""
        self.records.append((batch_idx, started, time.perf_counter()))

    def critical_path(self, first: int, last: int) -> list[float]:
        """Per step from ``first`` to ``last``, the seconds of the slowest replica's step body (the critical path)."""
        slowest = dict.fromkeys(range(first, last + 1), 0.0)
        for batch_idx, started, ended in self.records:
            if first <= batch_idx <= last:
                slowest[batch_idx] = max(slowest[batch_idx], ended - started)
        return list(slowest.values())


def typical_step(durations: list[float], cuda: bool) -> float:
    """The step time a run reports: on the CPU the median step, robust to a busy neighbour's bursts of load.

    On CUDA the per-step marks see only the CPU's side of asynchronous work, so there it is the mean, which equals
    the synchronized wall time of all timed steps divided by their number.
    """
    return statistics.fmean(durations) if cuda else statistics.median(durations)


class Clocked(nn.Module):
    """Wraps a bare net for the hand-written loops: records each forward on ``clock`` under ``clock.step``.

    The engines replicate this module, so in ``lightning_mgpu.engine.MGPUDataParallel`` and ``torch.nn.DataParallel``
    every replica's forward is timed inside its own thread, as ``BenchModule.training_step`` is under ``mgpu_dp``.
    """

    def __init__(self, net: nn.Module, clock: ReplicaClock) -> None:
        super().__init__()
        self.net = net
        self.clock = clock

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        output = self.net(x)
        self.clock.record(self.clock.step, started)
        return output
