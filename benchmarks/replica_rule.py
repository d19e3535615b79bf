"""What the replica-state rule costs per step: the engine with it against the engine without it, side by side.

The rule (``lightning_mgpu/replica_state``) runs each replica's call in a torch function mode that routes parameter
writes and random draws to the replica's own, reads the default generator's state around the call, compares each
replica's attributes before and after it, and gives every replica copies of the module's buffers, settled after it.
On the CPU proxy of ``benchmarks.overhead`` (one intra-op thread, ``nn.Sequential`` of ``Linear(4, 4)``, 8 rows,
forward + backward + SGD step), and on the same with a ``BatchNorm1d`` after every layer (rows ``bn``), each repeat
times a short loop of the engine with the rule and one without it (the engine as it was before the rule: replicas
that share the module's parameters and the default generator, the first replica the module's buffers), in
alternating order; a row reports the median of the per-repeat ratios and differences, with their min and max.

``--model conv`` measures the same on a step with work in it instead (rows ``conv``): a small convolutional net (a
3-to-16-channel stem, then ``depth`` blocks of ``Conv2d(16, 16, 3)``, ``BatchNorm2d`` and ``ReLU``, pooled into a
``Linear(16, 10)``) on 16 images of 16 x 16, at depths 1 and 4, where the proxy's step is almost all engine.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.overhead import FEATURES, _Case, _loop_us
from lightning_mgpu.engine.replicate import ReplicaCache
from lightning_mgpu.replica_state import ReplicaGuard

DEPTHS = (1, 16)
REPLICAS = (2, 4)
KINDS = ("linear", "bn")
CONV_DEPTHS = (1, 4)
CONV_IMAGES = (16, 3, 16, 16)
"""The ``conv`` rows' batch: images, channels, height, width."""
MODELS = {"proxy": (KINDS, DEPTHS), "conv": (("conv",), CONV_DEPTHS)}
BUDGET = 0.10
"""The most the rule may add to a step: 10%."""


class _WithoutRule(ReplicaCache):
    """The replica cache as it was before the rule: no guard, no snapshot of attributes, nothing settled by it."""

    def __init__(self) -> None:
        super().__init__(first_shares_buffers=True)

    def begin(self, method: str | None) -> list[ReplicaGuard] | None:
        structure = self._structure
        if structure is not None and structure.metrics is not None:
            structure.metrics.name(method)
        return None

    def settle(self, sizes: Sequence[int] | None, device: torch.device, method: str | None, **_: Any) -> None:
        self._aliases = []  # nothing was begun by the rule, so nothing is settled by it
        super().settle(sizes, device, method)


def _case(kind: str, depth: int, replicas: int) -> _Case:
    """One case of ``kind``: ``linear``, ``bn`` or ``conv``.

    ``benchmarks.overhead``'s case, the same net with a ``BatchNorm1d`` after every layer (``bn``), or the small
    convolutional net of the module docstring on its images (``conv``).
    """
    case = _Case(depth, replicas)
    if kind == "linear":
        return case
    case.close()
    with torch.random.fork_rng(devices=[]):  # weights and images from a fixed seed, the caller's generator untouched
        torch.manual_seed(0)
        if kind == "bn":
            layers = [(nn.Linear(FEATURES, FEATURES), nn.BatchNorm1d(FEATURES)) for _ in range(depth)]
            case.net = nn.Sequential(*[layer for pair in layers for layer in pair])
        else:
            blocks = [(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()) for _ in range(depth)]
            head = (nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
            case.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[m for block in blocks for m in block], *head)
            case.x = torch.randn(CONV_IMAGES)
    case.optimizer = torch.optim.SGD(case.net.parameters(), lr=1e-3)
    case.wrapper = type(case.wrapper)(case.net, [torch.device("cpu")] * replicas)
    return case


def measure(loops: int, repeats: int, warmup: int = 10, model: str = "proxy") -> list[dict[str, Any]]:
    """Microseconds per call with and without the rule, ``repeats`` times, alternating their order.

    ``model`` names the cases (``MODELS``): the proxy's ``linear`` and ``bn`` rows, or the ``conv`` rows.
    """
    kinds, depths = MODELS[model]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        for kind, depth, replicas in itertools.product(kinds, depths, REPLICAS):
            with_rule, without_rule = _case(kind, depth, replicas), _case(kind, depth, replicas)
            without_rule.wrapper._replicate = _WithoutRule()  # noqa: SLF001 - the variant measured against
            variants = {"with_rule": with_rule.engine, "without_rule": without_rule.engine}
            times: dict[str, list[float]] = {name: [] for name in variants}
            try:
                for function in variants.values():
                    _loop_us(function, warmup)
                gc.disable()
                for repeat in range(repeats):
                    order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
                    for name in order:
                        times[name].append(_loop_us(variants[name], loops)[0])
            finally:
                gc.enable()
                with_rule.close()
                without_rule.close()
            results.append({"kind": kind, "depth": depth, "replicas": replicas, **times})
    finally:
        torch.set_num_threads(threads)
    return results


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the median ratio with / without the rule and the median difference, with min and max."""
    rows = []
    for case in results:
        ratios = [a / b for a, b in zip(case["with_rule"], case["without_rule"], strict=True)]
        differences = [a - b for a, b in zip(case["with_rule"], case["without_rule"], strict=True)]
        rows.append(
            {
                "kind": case["kind"],
                "depth": case["depth"],
                "replicas": case["replicas"],
                "with_rule_us": statistics.median(case["with_rule"]),
                "without_rule_us": statistics.median(case["without_rule"]),
                "ratio": statistics.median(ratios),
                "ratio_range": (min(ratios), max(ratios)),
                "difference_us": statistics.median(differences),
                "within_budget": statistics.median(ratios) <= 1 + BUDGET,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print each case's row."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replica_rule", description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=20, help="calls per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, default=41, help="timed loops per variant and case (default 41)")
    parser.add_argument(
        "--model", choices=list(MODELS), default="proxy", help="the engine-only proxy (default) or a small conv net"
    )
    arguments = parser.parse_args(argv)
    for row in summary(measure(arguments.loops, arguments.repeats, model=arguments.model)):
        low, high = row["ratio_range"]
        print(
            f"{row['kind']:6s} depth {row['depth']:2d} x{row['replicas']}: with the rule {row['with_rule_us']:7.1f} us,"
            f" without {row['without_rule_us']:7.1f} us, ratio {row['ratio']:.3f} [{low:.3f}, {high:.3f}],"
            f" {row['difference_us']:+.1f} us; within {BUDGET:.0%}: {'met' if row['within_budget'] else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
