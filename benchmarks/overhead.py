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

Targets: one replica at most 5 us over the plain module; N replicas at most 40 us plus 2 us per module per replica.
The replicas run on the CPU whatever ``--device`` says: this measures the engine's own work, not the device's.
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

DEPTHS = (1, 16)
REPLICAS = (1, 2, 4)
ROWS = 8
FEATURES = 4
ONE_REPLICA_TARGET_US = 5.0
FIXED_TARGET_US = 40.0
PER_MODULE_REPLICA_TARGET_US = 2.0


def target_us(replicas: int, modules: int) -> float:
    """The most the engine may add per call: 5 us with one replica, else 40 us + 2 us per module per replica."""
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
    finally:
        if gc_was_enabled:
            gc.enable()
        for case in cases:
            case.close()
        torch.set_num_threads(threads)
    results = []
    for case in cases:
        times, cpu_times = wall[id(case)], cpu[id(case)]
        results.append(
            {
                "depth": case.depth,
                "replicas": case.replicas,
                "modules": case.modules,
                "engine_us": times["engine"],
                "sequential_us": times["sequential"],
                "overhead_us": _differences(times),
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
        overhead = statistics.median(case["overhead_us"])
        rows.append(
            {
                "depth": case["depth"],
                "replicas": case["replicas"],
                "modules": case["modules"],
                "sequential_us": statistics.median(case["sequential_us"]),
                "engine_us": statistics.median(case["engine_us"]),
                "overhead_us": overhead,
                "min_us": min(case["overhead_us"]),
                "max_us": max(case["overhead_us"]),
                "cpu_overhead_us": statistics.median(case["cpu_overhead_us"]),
                "target_us": case["target_us"],
                "met": overhead <= case["target_us"],
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
            f" {row['max_us']:+.1f}] us (CPU {row['cpu_overhead_us']:+7.1f}), target <= {row['target_us']:.0f}:"
            f" {'met' if row['met'] else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
