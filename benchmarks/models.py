"""The benchmark models, their synthetic data, and the settings of each mode (smoke, quick, full).

A small MLP, whose step is cheap enough for per-step overhead to dominate, and a conv net whose step is mostly
compute; both built from a fixed seed and trained on seeded data, so every variant sees the same weights and rows.
Only ``torch`` is imported here: the hand-written DDP loop runs without Lightning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from typing_extensions import override

CLASSES = 10


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and its run: ``batch`` rows per process or replica, ``warmup`` untimed then ``steps`` timed steps.

    ``width``: the MLP's hidden width or the first convolution's channels; ``features``: the MLP's inputs or the
    side of the conv net's square RGB images.
    """

    name: str
    batch: int
    warmup: int
    steps: int
    width: int
    features: int


@dataclasses.dataclass(frozen=True)
class Mode:
    """How long a run takes; ``ddp_rounds``: how often the variants of one multi-process job take turns."""

    name: str
    models: tuple[ModelSpec, ...]
    ddp_repeats: int
    ddp_rounds: int
    local_repeats: int
    profile_steps: int
    overhead_loops: int
    overhead_repeats: int


_MODES = {  # ddp_repeats, ddp_rounds, local_repeats, profile_steps, overhead_loops, overhead_repeats
    "smoke": (1, 1, 1, 2, 2, 1),
    "quick": (3, 3, 5, 40, 20, 41),
    "full": (5, 3, 9, 100, 50, 81),
}


def mode_settings(name: str, device: str) -> Mode:
    """The settings of mode ``name`` (``smoke``, ``quick``, ``full``) on ``device`` (``cpu``, ``cuda``)."""
    scale = 8 if device == "cuda" else 1  # CPU-sized batches would leave a GPU idle
    if name == "smoke":
        models = (ModelSpec("mlp", 8, 1, 3, 32, 16), ModelSpec("conv", 4, 1, 2, 4, 8))
    else:
        full = name == "full"
        models = (
            ModelSpec("mlp", 64 * scale, 50 if full else 20, 400 if full else 200, width=256, features=64),
            ModelSpec("conv", 32 * scale, 5 if full else 3, 40 if full else 20, width=32, features=32),
        )
    return Mode(name, models, *_MODES[name])


@contextlib.contextmanager
def intra_op_threads(device: str, count: int = 1) -> Iterator[None]:
    """On the CPU, run the block with ``count`` intra-op threads; the number is restored after it."""
    previous = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_net(spec: ModelSpec) -> nn.Module:
    """The bare ``nn.Module`` of ``spec``, with weights from a fixed seed (no BatchNorm: no buffers to sync)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    w = spec.width
    try:
        if spec.name == "mlp":
            return nn.Sequential(nn.Linear(spec.features, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                 nn.Linear(w, CLASSES))  # fmt: skip
        return nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, CLASSES),
        )  # fmt: skip
    finally:
        torch.random.set_rng_state(state)


def dataset(spec: ModelSpec, rows: int) -> TensorDataset:
    """``rows`` seeded samples and labels for ``spec``, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    shape = (spec.features,) if spec.name == "mlp" else (3, spec.features, spec.features)
    x = torch.randn(rows, *shape, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (rows,), generator=generator))


def optimizer(parameters: Any) -> torch.optim.Optimizer:
    """The optimizer every variant uses."""
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def loss_of(net: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of ``net`` on one (chunk of a) batch."""
    x, y = batch
    return nn.functional.cross_entropy(net(x), y)


def typical_step(durations: list[float], cuda: bool) -> float:
    """The median step on the CPU (robust to a neighbour's bursts); on CUDA the mean, as the marks only see launches."""
    return statistics.fmean(durations) if cuda else statistics.median(durations)


class ReplicaClock:
    """Wall time of every call of the step body, from whichever replica (a shallow copy sharing this clock) runs it."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float, float]] = []
        self.step = 0

    def record(self, step: int, started: float) -> None:
        """The step body of ``step`` started at ``started`` and ends now."""
        self.records.append((step, started, time.perf_counter()))

    def critical_path(self, first: int, last: int) -> list[float]:
        """Per step from ``first`` to ``last``, the seconds of the slowest replica's step body."""
        slowest = dict.fromkeys(range(first, last + 1), 0.0)
        for step, started, ended in self.records:
            if first <= step <= last:
                slowest[step] = max(slowest[step], ended - started)
        return list(slowest.values())


class Clocked(nn.Module):
    """A bare net whose forward is recorded on ``clock`` under ``clock.step``, in each replica's own thread."""

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
