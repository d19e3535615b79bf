"""What ``Trainer(sync_batchnorm=True)`` costs under ``mgpu_ddp`` on CPU processes, beside ``sync_batchnorm=False``.

``python -m benchmarks.ddp_batchnorm [--quick|--smoke]`` starts 2 gloo processes with one intra-op thread each, which
train small convolution networks (3x3 convolutions with 8 channels on 8x8 inputs, batch 8 per process, a BatchNorm
layer after each convolution: 8 or 16 of them) in a ``DistributedDataParallel`` loop, as ``mgpu_ddp`` runs it: a
forward, a backward and an SGD step. Per model the two variants take turns in every repeat, the order alternating:

- ``sync_off``: the BatchNorm layers as built, each process normalising its own rows (``sync_batchnorm=False``);
- ``sync_on``: the same layers converted as ``mgpu_ddp`` converts them for ``Trainer(sync_batchnorm=True)`` on CPU
  processes (``MGPUSyncBatchNorm``: one all-reduce per layer in the forward, one in the backward).

Beside them, ``collectives`` times the two all-reduces a layer adds per step (of the sizes the layer sends), alone:
the floor that the process group's latency sets. A step lasts as long as its slowest process. A row reports the
medians over repeats of the step times, the ratio ``sync_on / sync_off`` with its min and max, the cost per BatchNorm
layer per step (the difference over the layers), and that floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_suite import ROOT, Job, _wait, free_port, rank_env

WORLD_SIZE = 2
ROWS, CHANNELS, SIZE = 8, 8, 8
MODELS = {"conv8_bn8": 8, "conv16_bn16": 16}
"""Per model, its convolutions, each followed by a BatchNorm layer."""
_SETTINGS = {"smoke": (1, 1, 1), "quick": (20, 7, 3), "full": (50, 15, 5)}
"""Per mode: steps per timed loop, repeats, warm-up steps."""
VARIANTS = ("sync_off", "sync_on")
_COLLECTIVES = 50
"""Timed pairs of all-reduces per repeat."""


def build(layers: int) -> nn.Sequential:
    """``layers`` 3x3 convolutions, each followed by BatchNorm and ReLU, then a linear head; from a fixed seed."""
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False), nn.BatchNorm2d(CHANNELS), nn.ReLU()]
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(CHANNELS * SIZE * SIZE, 1))


def _variant(name: str, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    from lightning_mgpu.sync_batchnorm import SyncBatchNormLayers

    model: nn.Module = build(layers)
    if name == "sync_on":
        model = SyncBatchNormLayers(TorchSyncBatchNorm(), torch.device("cpu")).apply(model)
    wrapped = DistributedDataParallel(model)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, count: int) -> None:
    for _ in range(count):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def worker(mode: str, out: Path) -> None:
    """One process: every model's variants in turn, ``repeats`` times; writes ``out/rank<R>.json``."""
    from lightning_mgpu.strategies.ddp import release_process_group_at_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    steps, repeats, warmup = _SETTINGS[mode]
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(ROWS, CHANNELS, SIZE, SIZE, generator=generator), torch.randn(ROWS, 1, generator=generator)
    report: dict[str, dict[str, list[float]]] = {}
    for model_name, layers in MODELS.items():
        variants = {name: _variant(name, layers) for name in VARIANTS}
        for model, optimizer in variants.values():
            _steps(model, optimizer, x, y, warmup)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(repeats):
            for name in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                dist.barrier()
                started = time.perf_counter()
                _steps(*variants[name], x, y, steps)
                times[name].append((time.perf_counter() - started) / steps)
        report[model_name] = times
    forward, backward = torch.zeros(WORLD_SIZE, 2 * CHANNELS + 1, dtype=torch.float64), torch.zeros(2 * CHANNELS)
    report["collectives"] = {"pair": []}
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(_COLLECTIVES):
            dist.all_reduce(forward)
            dist.all_reduce(backward)
        report["collectives"]["pair"].append((time.perf_counter() - started) / _COLLECTIVES)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    release_process_group_at_exit()


def measure(mode: str) -> list[dict[str, Any]]:
    """Run the job; per model, the variants' median step, the ratio with its spread, the cost per layer."""
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-bn-") as tmp:
        out = Path(tmp)
        command = [sys.executable, "-m", "benchmarks.ddp_batchnorm", "--worker", "--mode", mode, "--out", tmp]
        port = free_port()
        logs = [out / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
        processes = []
        for rank, log in enumerate(logs):
            with log.open("w") as sink:
                env = rank_env(rank, WORLD_SIZE, port)
                processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT))
        _wait(processes, logs, Job(VARIANTS, WORLD_SIZE))
        reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    rows = []
    pairs = [max(per_rank) for per_rank in zip(*(r["collectives"]["pair"] for r in reports), strict=True)]
    for model_name, layers in MODELS.items():
        # Ranks meet in every step's all-reduces, so a repeat lasts as long as its slowest rank.
        step = {
            name: [max(per_rank) for per_rank in zip(*(r[model_name][name] for r in reports), strict=True)]
            for name in VARIANTS
        }
        ratios = [on / off for on, off in zip(step["sync_on"], step["sync_off"], strict=True)]
        on, off = statistics.median(step["sync_on"]), statistics.median(step["sync_off"])
        rows.append({
            "model": model_name, "layers": layers, "sync_off_ms": off * 1e3, "sync_on_ms": on * 1e3,
            "sync_on_vs_off": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "per_layer_us": (on - off) / layers * 1e6, "collectives_us": statistics.median(pairs) * 1e6,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print one row per model (or, with ``--worker``, be one of the job's processes)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_const", dest="mode", const="quick")
    modes.add_argument("--smoke", action="store_const", dest="mode", const="smoke")
    modes.add_argument("--mode", choices=list(_SETTINGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = args.mode or "full"
    if args.worker:
        worker(mode, args.out)
        return 0
    print("| model | sync_off ms | sync_on ms | sync_on / sync_off (min-max) | per BatchNorm layer | its all-reduces |")
    for row in measure(mode):
        print(
            f"| {row['model']} | {row['sync_off_ms']:.2f} | {row['sync_on_ms']:.2f} |"
            f" {row['sync_on_vs_off']:.2f}x ({row['min']:.2f}-{row['max']:.2f}) | {row['per_layer_us']:.0f} us |"
            f" {row['collectives_us']:.0f} us |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
