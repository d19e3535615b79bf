"""What exact BatchNorm costs under ``mgpu_dp``: ``sync_batchnorm=True`` against ``False``, per layer, in one run.

``python -m benchmarks.batchnorm [--quick|--smoke]`` runs, on 2 virtual CPU replicas with one intra-op thread, a
forward and a backward of small convolution networks (3x3 convolutions with 8 channels on 8x8 inputs, batch 8):
8 or 16 convolutions with one BatchNorm layer or one after each, and a ResNet-style stack of residual blocks (two
convolutions and two BatchNorm layers each). Per model the variants take turns in every repeat, the order alternating:

- ``single``: the plain module on the whole batch;
- ``in_turn``: the same two chunks run one after the other on the plain module (each normalised on its own);
- ``sync_off``: ``MGPUDataParallel(sync_batchnorm=False)``, each chunk normalised by its own statistics;
- ``sync_on``: ``MGPUDataParallel(sync_batchnorm=True)``, every chunk by the whole batch's.

Beside them, ``handoff`` times the replica threads doing nothing but meeting, through the same rendezvous as the
exchange, as many times as the exchange meets per layer (once): the floor a hand-off between these threads sets.
A row reports medians over repeats of the step times, the ratio ``sync_on / sync_off`` with its min and max, the
exchange's cost per BatchNorm layer per step (the difference over the layers) and that cost above the hand-offs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.batchnorm import ReplicaRendezvous
from lightning_mgpu.engine.parallel_apply import ParallelApply

REPLICAS = 2
ROWS, CHANNELS, SIZE = 8, 8, 8
EXCHANGES_PER_LAYER = 1
"""How often the replicas meet per BatchNorm call (the last to arrive does the work of every chunk)."""
_SETTINGS = {"smoke": (1, 1, 1), "quick": (10, 7, 3), "full": (30, 15, 5)}
"""Per mode: steps per timed loop, repeats, warm-up steps."""
_MEETINGS = 32
"""Meetings per timed hand-off call."""
VARIANTS = ("single", "in_turn", "sync_off", "sync_on")


class _Block(nn.Module):
    """A residual block: two convolutions, each followed by BatchNorm, added to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False),
            nn.BatchNorm2d(CHANNELS),
            nn.ReLU(),
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False),
            nn.BatchNorm2d(CHANNELS),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def _convolutions(depth: int, every: int) -> nn.Module:
    """``depth`` convolutions with ReLU, a BatchNorm layer after every ``every``-th."""
    layers: list[nn.Module] = []
    for index in range(depth):
        layers.append(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1))
        if (index + 1) % every == 0:
            layers.append(nn.BatchNorm2d(CHANNELS))
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "conv8_bn1": lambda: _convolutions(8, 8),
    "conv8_bn8": lambda: _convolutions(8, 1),
    "conv16_bn1": lambda: _convolutions(16, 16),
    "conv16_bn16": lambda: _convolutions(16, 1),
    "resnet4": lambda: nn.Sequential(*[_Block() for _ in range(4)]),
}


def _layers(model: nn.Module) -> int:
    return sum(isinstance(module, nn.BatchNorm2d) for module in model.modules())


class _Case:
    """One model's four variants, each a forward and a backward of the same batch."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = MODELS[name]()
        self.layers = _layers(self.model)
        self.x = torch.randn(ROWS, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        devices = [torch.device("cpu")] * REPLICAS
        self.wrappers = {sync: MGPUDataParallel(self.model, devices, sync_batchnorm=sync) for sync in (False, True)}

    def single(self) -> None:
        self.model(self.x).sum().backward()

    def in_turn(self) -> None:
        torch.cat([self.model(chunk) for chunk in self.x.chunk(REPLICAS)]).sum().backward()

    def sync_off(self) -> None:
        self.wrappers[False](self.x).sum().backward()

    def sync_on(self) -> None:
        self.wrappers[True](self.x).sum().backward()

    def close(self) -> None:
        for wrapper in self.wrappers.values():
            wrapper.close()


class _Handoffs:
    """The replica threads meeting ``meetings`` times in one call and nothing else: the floor of the exchange."""

    def __init__(self) -> None:
        self.threads = ParallelApply(REPLICAS)
        self.devices = [torch.device("cpu")] * REPLICAS

    def __call__(self, meetings: int) -> None:
        rendezvous = ReplicaRendezvous(REPLICAS)

        def meet(index: int) -> Callable[[], None]:
            def call() -> None:
                for key in range(meetings):
                    rendezvous.combine(index, key, None, "a hand-off", list)

            return call

        self.threads([meet(index) for index in range(REPLICAS)], self.devices)

    def close(self) -> None:
        self.threads.close()


def _seconds(function: Callable[[], None], loops: int) -> float:
    started = time.perf_counter()
    for _ in range(loops):
        function()
    return (time.perf_counter() - started) / loops


def measure(mode: str) -> dict[str, Any]:
    """Per model, every variant's seconds per step in every repeat; and the hand-off's seconds per meeting."""
    loops, repeats, warmup = _SETTINGS[mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cases = [_Case(name) for name in MODELS]
    handoffs = _Handoffs()
    times: dict[str, dict[str, list[float]]] = {case.name: {variant: [] for variant in VARIANTS} for case in cases}
    meeting: list[float] = []
    gc_was_enabled = gc.isenabled()
    try:
        for case in cases:
            for _ in range(warmup):
                for variant in VARIANTS:
                    getattr(case, variant)()
        gc.collect()
        gc.disable()
        for repeat in range(repeats):
            for case in cases:
                order = VARIANTS if repeat % 2 == 0 else tuple(reversed(VARIANTS))
                for variant in order:
                    times[case.name][variant].append(_seconds(getattr(case, variant), loops))
            met = _seconds(functools.partial(handoffs, _MEETINGS), loops)
            meeting.append((met - _seconds(functools.partial(handoffs, 0), loops)) / _MEETINGS)
    finally:
        if gc_was_enabled:
            gc.enable()
        for case in cases:
            case.close()
        handoffs.close()
        torch.set_num_threads(threads)
    return {"models": times, "layers": {case.name: case.layers for case in cases}, "handoff_s": meeting}


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: medians, the on/off ratio with its range, and the cost per layer above the hand-offs."""
    handoff = statistics.median(result["handoff_s"])
    rows = []
    for name, times in result["models"].items():
        ratios = [on / off for on, off in zip(times["sync_on"], times["sync_off"], strict=True)]
        per_layer = statistics.median(
            (on - off) / result["layers"][name] for on, off in zip(times["sync_on"], times["sync_off"], strict=True)
        )
        rows.append(
            {
                "model": name,
                "layers": result["layers"][name],
                **{f"{variant}_ms": statistics.median(times[variant]) * 1e3 for variant in VARIANTS},
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "per_layer_us": per_layer * 1e6,
                "above_handoffs_us": (per_layer - EXCHANGES_PER_LAYER * handoff) * 1e6,
                "handoff_us": handoff * 1e6,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure and print one line per model."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batchnorm", description=__doc__.split("\n\n")[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true")
    speed.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    rows = summary(measure("smoke" if args.smoke else "quick" if args.quick else "full"))
    print(f"2 CPU replicas, 1 intra-op thread; a hand-off between the replica threads: {rows[0]['handoff_us']:.0f} us")
    for row in rows:
        print(
            f"{row['model']:12s} {row['layers']:2d} BatchNorm: one device {row['single_ms']:.2f} ms, in turn"
            f" {row['in_turn_ms']:.2f} ms, sync off {row['sync_off_ms']:.2f} ms, sync on {row['sync_on_ms']:.2f} ms;"
            f" ratio {row['ratio']:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]; per layer"
            f" {row['per_layer_us']:+.0f} us, {row['above_handoffs_us']:+.0f} us above the hand-off"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
