"""The engine's own cost per step: ``MGPUDataParallel`` with N virtual CPU replicas against the same N chunks in turn.

A proxy that makes the engine's Python work the whole difference: one intra-op thread, an ``nn.Sequential`` of
``Linear(4, 4)`` layers (depth 1 and 16), 8 rows, and per call a forward, a backward and an SGD step. Per case:

- ``engine``: ``MGPUDataParallel(net, [cpu] * N)(x)``, then the loss, its backward and the optimizer step;
- ``sequential``: the same N chunks of the same rows run one after another on ``net`` in the calling thread, the
  outputs concatenated, then the same loss, backward and step (with N = 1: ``net(x)``, the plain module).

Both compute the same numbers; the difference per call is what the engine costs (scatter, replicas, hand-off to the
replica threads, gather, and the replicas' extra autograd nodes). Each repeat times a short loop of each variant of
each case in turn (the order alternating between repeats, the garbage collector paused as in ``timeit``), so a
neighbour's burst of load hits both variants of a pair alike; a row reports the median of the per-repeat
differences, with the min and max. Beside the wall time, the process's CPU time (all threads) per call is
recorded: it leaves out waiting (for a thread to wake, for a core), which is what a busy machine inflates.

The floor: in the same repeats, ``floor`` hands N no-op calls to the engine's own N replica threads and waits for
them (``ParallelApply``, as every engine call does); no engine can do a call across N threads for less. Each case
reports its overhead and that overhead above the floor of the same repeat.

Targets: one replica (no thread) at most 5 us over the plain module; N replicas at most 20 us plus 2 us per module
per replica above the floor. The replicas run on the CPU whatever ``--device`` says: this measures the engine's own
work, not the device's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.parallel_apply import ParallelApply

DEPTHS = (1, 16)
REPLICAS = (1, 2, 4)
ROWS = 8
FEATURES = 4
ONE_REPLICA_TARGET_US = 5.0
FIXED_TARGET_US = 20.0
PER_MODULE_REPLICA_TARGET_US = 2.0


def target_us(replicas: int, modules: int) -> float:
    """The most the engine may add per call: 5 us with one replica, else 20 us + 2 us per module per replica.

    With several replicas the bound is above the floor: a no-op round trip to the replica threads.
    """
    if replicas == 1:
        return ONE_REPLICA_TARGET_US
    return FIXED_TARGET_US + PER_MODULE_REPLICA_TARGET_US * modules * replicas


def net_of(depth: int) -> nn.Sequential:
    """``depth`` layers of ``Linear(4, 4)``, with weights from a fixed seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return nn.Sequential(*[nn.Linear(FEATURES, FEATURES) for _ in range(depth)])
    finally:
        torch.random.set_rng_state(generator_state)


class _Case:
    """One (depth, replicas) case: the two step functions over one net, one optimizer and one batch."""

    def __init__(self, depth: int, replicas: int) -> None:
        self.depth = depth
        self.replicas = replicas
        self.net = net_of(depth)
        self.modules = len(list(self.net.modules()))
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3)
        self.x = torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(depth))
        self.wrapper = MGPUDataParallel(self.net, [torch.device("cpu")] * replicas)

    def engine(self) -> None:
        self._learn(self.wrapper(self.x))

    def sequential(self) -> None:
        if self.replicas == 1:
            self._learn(self.net(self.x))
        else:
            self._learn(torch.cat([self.net(chunk) for chunk in self.x.chunk(self.replicas)]))

    def _learn(self, output: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output.square().mean().backward()
        self.optimizer.step()

    def close(self) -> None:
        self.wrapper.close()


class Floor:
    """A no-op round trip to ``replicas`` replica threads: the engine's own threads, handed calls that do nothing."""

    def __init__(self, replicas: int) -> None:
        self.threads = ParallelApply(replicas)
        self.calls = [_nothing] * replicas
        self.devices = [torch.device("cpu")] * replicas

    def __call__(self) -> None:
        """One round trip: every thread runs a call that does nothing; returns when all have."""
        self.threads(self.calls, self.devices)

    def close(self) -> None:
        """Stop the threads."""
        self.threads.close()


def _nothing() -> None:
    return None


def _loop_us(function: Callable[[], None], loops: int) -> tuple[float, float]:
    """Wall and process CPU microseconds per call of ``function``, over ``loops`` calls."""
    cpu = time.process_time()
    wall = time.perf_counter()
    for _ in range(loops):
        function()
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    return wall / loops * 1e6, cpu / loops * 1e6


def measure(loops: int, repeats: int, warmup: int = 20) -> list[dict[str, Any]]:
    """Every case's engine and sequential microseconds per call, ``repeats`` times; see the module docstring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cases = [_Case(depth, replicas) for depth in DEPTHS for replicas in REPLICAS]
    floors = {replicas: Floor(replicas) for replicas in REPLICAS if replicas > 1}
    floor_us: dict[int, list[float]] = {replicas: [] for replicas in REPLICAS}
    wall: dict[int, dict[str, list[float]]] = {id(case): {"engine": [], "sequential": []} for case in cases}
    cpu: dict[int, dict[str, list[float]]] = {id(case): {"engine": [], "sequential": []} for case in cases}
    gc_was_enabled = gc.isenabled()
    try:
        for case in cases:
            for _ in range(warmup):
                case.engine()
                case.sequential()
        gc.collect()
        gc.disable()
        for repeat in range(repeats):
            for case in cases:
                for variant in ("engine", "sequential") if repeat % 2 == 0 else ("sequential", "engine"):
                    wall_us, cpu_us = _loop_us(getattr(case, variant), loops)
                    wall[id(case)][variant].append(wall_us)
                    cpu[id(case)][variant].append(cpu_us)
            for replicas in REPLICAS:
                floor_us[replicas].append(_loop_us(floors[replicas], loops)[0] if replicas in floors else 0.0)
    finally:
        if gc_was_enabled:
            gc.enable()
        for case in cases:
            case.close()
        for round_trips in floors.values():
            round_trips.close()
        torch.set_num_threads(threads)
    results = []
    for case in cases:
        times, cpu_times = wall[id(case)], cpu[id(case)]
        overhead = _differences(times)
        floor = floor_us[case.replicas]
        results.append(
            {
                "depth": case.depth,
                "replicas": case.replicas,
                "modules": case.modules,
                "engine_us": times["engine"],
                "sequential_us": times["sequential"],
                "overhead_us": overhead,
                "floor_us": floor,
                "above_floor_us": [cost - round_trip for cost, round_trip in zip(overhead, floor, strict=True)],
                "cpu_overhead_us": _differences(cpu_times),
                "target_us": target_us(case.replicas, case.modules),
            }
        )
    return results


def _differences(times: dict[str, list[float]]) -> list[float]:
    return [engine - sequential for engine, sequential in zip(times["engine"], times["sequential"], strict=True)]


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per case, for the report's table and the README."""
    rows = []
    for case in results:
        above_floor = statistics.median(case["above_floor_us"])
        rows.append(
            {
                "depth": case["depth"],
                "replicas": case["replicas"],
                "modules": case["modules"],
                "sequential_us": statistics.median(case["sequential_us"]),
                "engine_us": statistics.median(case["engine_us"]),
                "overhead_us": statistics.median(case["overhead_us"]),
                "min_us": min(case["overhead_us"]),
                "max_us": max(case["overhead_us"]),
                "floor_us": statistics.median(case["floor_us"]),
                "above_floor_us": above_floor,
                "above_floor_min_us": min(case["above_floor_us"]),
                "above_floor_max_us": max(case["above_floor_us"]),
                "cpu_overhead_us": statistics.median(case["cpu_overhead_us"]),
                "target_us": case["target_us"],
                "met": above_floor <= case["target_us"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.overhead [--loops N] [--repeats N]``: the overhead table alone (a minute or less)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=20, help="calls per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, default=41, help="timed loops per variant and case (default 41)")
    args = parser.parse_args(argv)
    for row in summary(measure(args.loops, args.repeats)):
        print(
            f"depth {row['depth']:2d} x{row['replicas']}: sequential {row['sequential_us']:7.1f} us, engine"
            f" {row['engine_us']:7.1f} us, overhead {row['overhead_us']:+7.1f} [{row['min_us']:+.1f},"
            f" {row['max_us']:+.1f}] us (CPU {row['cpu_overhead_us']:+7.1f}); no-op round trip"
            f" {row['floor_us']:5.1f} us, above it {row['above_floor_us']:+7.1f} us, target <= {row['target_us']:.0f}:"
            f" {'met' if row['met'] else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
