"""The engine of this tree against the engine of another source tree of the package, side by side in one run.

``benchmarks.replica_rule`` isolates the replica-state rule inside one engine; this compares whole engines, as a
user moving from one release to another meets them: the same proxy step (``nn.Sequential`` of ``Linear(4, 4)``,
rows ``bn`` with a ``BatchNorm1d`` after every layer; 8 rows, forward + backward + SGD step, one intra-op thread)
under ``MGPUDataParallel`` on virtual CPU replicas, one worker process per tree, importing the package from its
tree. Each repeat times a loop of calls in each worker, the order alternating; a row reports the median of the
per-repeat ratios (this tree / the other) with their min and max.

``--step lightning`` times a whole training step as a user meets it instead: the same net in a ``LightningModule``
whose ``training_step`` returns the loss and logs it, under ``Trainer(strategy="mgpu_dp", devices=N)`` on the CPU,
each timed loop a run of consecutive batches of one ``fit`` (Lightning's loop, the batch fetch, the step, backward
and the optimizer step).

    git worktree add /tmp/before <commit>
    python -m benchmarks.against /tmp/before
    python -m benchmarks.against /tmp/before --step lightning
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CASES = tuple((kind, depth, replicas) for kind in ("linear", "bn") for depth in (1, 16) for replicas in (2, 4))
"""``benchmarks.replica_rule``'s cases: (kind, depth, replicas)."""

_PROXY = r"""
import gc, os, sys, time
import torch
from torch import nn

torch.set_num_threads(1)
kind, depth, replicas, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def proxy_net():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers.append(nn.Linear(4, 4))
            if kind == "bn":
                layers.append(nn.BatchNorm1d(4))
    return nn.Sequential(*layers)
"""
"""Both workers' start: the arguments, one intra-op thread, and the proxy net, built from a fixed seed."""

_WORKER = (
    _PROXY
    + r"""
from lightning_mgpu import MGPUDataParallel

net = proxy_net()
optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(depth))
wrapper = MGPUDataParallel(net, [torch.device("cpu")] * replicas)


def step():
    output = wrapper(x)
    optimizer.zero_grad()
    output.square().mean().backward()
    optimizer.step()


for _ in range(warmup):
    step()
gc.disable()
import lightning_mgpu

print("ready", lightning_mgpu.__file__, flush=True)
for line in sys.stdin:
    loops = int(line)
    start = time.perf_counter()
    for _ in range(loops):
        step()
    print((time.perf_counter() - start) / loops * 1e6, flush=True)
"""
)

LIGHTNING_CLOCK = r"""
answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
sys.stdout = sys.stderr  # Lightning's messages stay out of the answers


class Clock(L.Callback):
    # Answers each request for N steps with the microseconds per step of the next N consecutive batches.
    def __init__(self):
        self.left = 0
        self.loops = 0
        self.start = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx < warmup:
            return
        if self.left == 0:
            if self.start is None:
                gc.disable()
                print("ready", lightning_mgpu.__file__, file=answers, flush=True)
            else:
                print((time.perf_counter() - self.start) / self.loops * 1e6, file=answers, flush=True)
            line = sys.stdin.readline()
            if not line:
                answers.close()
                os._exit(0)
            self.loops = self.left = int(line)
            self.start = time.perf_counter()
        self.left -= 1
"""
"""A worker's ``Clock`` callback, which times a Lightning ``fit`` in runs of consecutive batches as ``Worker`` asks.

It needs ``gc``, ``os``, ``sys``, ``time``, ``lightning.pytorch as L``, ``lightning_mgpu`` and ``warmup`` (the batches
before the first timed run) in the script.
"""

_LIGHTNING_WORKER = (
    _PROXY
    + r"""
import lightning.pytorch as L
import lightning_mgpu  # registers mgpu_dp
"""
    + LIGHTNING_CLOCK
    + r"""


class Proxy(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = proxy_net()

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)



rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(depth)).repeat(100_000, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=8)
trainer = L.Trainer(
    accelerator="cpu",
    devices=replicas,
    strategy="mgpu_dp",
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Clock()],
)
trainer.fit(Proxy(), loader)
"""
)
WORKERS = {"engine": _WORKER, "lightning": _LIGHTNING_WORKER}
"""What a worker times per call: the engine's call with backward and an SGD step, or a Lightning training step."""


class Worker:
    """One process running ``script`` with ``arguments``, the package imported from ``tree``.

    The script prints ``ready <lightning_mgpu.__file__>``, then answers each line ``N`` it reads with the
    microseconds per call of its next ``N`` calls.
    """

    def __init__(self, tree: Path, script: str, arguments: Sequence[object]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", script, *map(str, arguments)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=tree,  # ``python -c`` puts its folder first on sys.path, before PYTHONPATH
        )
        ready, _, imported = self._read().partition(" ")
        if ready != "ready":
            raise RuntimeError(f"the worker for {tree} did not start; run the proxy there by hand to see why")
        if not Path(imported).resolve().is_relative_to(tree.resolve()):
            self.close()
            raise RuntimeError(
                f"the worker for {tree} imported lightning_mgpu from {imported}: an install of the package comes"
                " before the tree on sys.path there; compare in an environment without it"
            )

    def loop_us(self, loops: int) -> float:
        """Microseconds per call over ``loops`` calls."""
        assert self._process.stdin is not None
        self._process.stdin.write(f"{loops}\n")
        self._process.stdin.flush()
        return float(self._read())

    def _read(self) -> str:
        assert self._process.stdout is not None
        return self._process.stdout.readline().strip()

    def close(self) -> None:
        """End the process."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=60)


def take_turns(workers: dict[str, Worker], loops: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per call of each worker, ``repeats`` loops of ``loops`` calls each, the order alternating.

    Every worker is closed afterwards, also when one fails.
    """
    times: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for repeat in range(repeats):
            order = list(workers) if repeat % 2 == 0 else list(reversed(workers))
            for name in order:
                times[name].append(workers[name].loop_us(loops))
    finally:
        for worker in workers.values():
            worker.close()
    return times


def measure(
    other: Path,
    loops: int = 20,
    repeats: int = 41,
    warmup: int = 10,
    cases: Sequence[tuple[str, int, int]] = CASES,
    this: Path | None = None,
    step: str = "engine",
) -> list[dict[str, Any]]:
    """Per case: microseconds per ``step`` (a ``WORKERS`` key) of this tree and of ``other``, alternating."""
    this = this or Path(__file__).resolve().parents[1]
    results = []
    for case in cases:
        arguments = (*case, warmup)
        workers = {name: Worker(tree, WORKERS[step], arguments) for name, tree in (("this", this), ("other", other))}
        times = take_turns(workers, loops, repeats)
        kind, depth, replicas = case
        ratios = [a / b for a, b in zip(times["this"], times["other"], strict=True)]
        results.append(
            {
                "kind": kind,
                "depth": depth,
                "replicas": replicas,
                "this_us": statistics.median(times["this"]),
                "other_us": statistics.median(times["other"]),
                "ratio": statistics.median(ratios),
                "ratio_range": (min(ratios), max(ratios)),
            }
        )
    return results


def main(argv: list[str] | None = None) -> None:
    """Print each case's row."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.against", description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the root of the other tree (the folder holding lightning_mgpu/)")
    parser.add_argument("--loops", type=int, default=20, help="calls per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, default=41, help="timed loops per tree and case (default 41)")
    parser.add_argument(
        "--step",
        choices=sorted(WORKERS),
        default="engine",
        help="what is timed: the engine's call (default) or a Lightning training step under mgpu_dp",
    )
    arguments = parser.parse_args(argv)
    if not (arguments.other / "lightning_mgpu" / "__init__.py").is_file():
        parser.error(f"{arguments.other} holds no lightning_mgpu/: pass the root of a checkout of the package")
    for row in measure(arguments.other, arguments.loops, arguments.repeats, step=arguments.step):
        low, high = row["ratio_range"]
        print(
            f"{row['kind']:6s} depth {row['depth']:2d} x{row['replicas']}: this tree {row['this_us']:8.1f} us,"
            f" the other {row['other_us']:8.1f} us, ratio {row['ratio']:.3f} [{low:.3f}, {high:.3f}]"
        )


if __name__ == "__main__":
    main()
