"""What ``MGPUDDPStrategy(gather_step_end=True)`` costs: bytes per rank, and a step's time against no gather.

``python -m benchmarks.gather [--quick|--smoke] [--device cpu|cuda]`` starts 2 processes (gloo on the CPU, NCCL on
GPUs), each training a CLIP-style pair of encoders under ``DistributedDataParallel`` with the symmetric in-batch loss,
two ways taking turns step by step in the same processes: the loss over the rank's own rows (what ``mgpu_ddp`` does
without the option) and over every rank's rows gathered by the strategy's own ``RankGather`` (with it). It reports
the median step time of each and their ratio, and, for a CLIP-sized output (256 rows per rank, 512-wide embeddings
of two towers in float32), the bytes every rank holds: its own outputs, the gathered ones (the world size times as
many), and the gradient of the gathered ones that the backward all-reduces (as many again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.strategies.ddp import release_process_group_at_exit
from lightning_mgpu.strategies.rank_gather import RankGather

CLIP_ROWS, CLIP_WIDTH = 256, 512
"""A CLIP-sized step: rows per rank and embedding width (ViT-B/32's), two towers, float32."""
_SETTINGS = {"smoke": (4, 2, 1), "quick": (64, 20, 5), "full": (128, 60, 10)}
"""Per mode: rows per rank, timed steps per way, warm-up steps."""


def _towers(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"image": nn.Linear(64, width), "text": nn.Linear(32, width)})


def _clip_loss(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    logits = 14.3 * F.normalize(image, dim=1) @ F.normalize(text, dim=1).T
    labels = torch.arange(image.shape[0], device=image.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _rank(rank: int, world_size: int, port: int, mode: str, device_kind: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_kind == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    rows, steps, warmup = _SETTINGS[mode]
    towers = _towers(CLIP_WIDTH if cuda else 128).to(device)
    model = nn.parallel.DistributedDataParallel(towers, device_ids=[rank] if cuda else None)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    gather = RankGather("training_step")
    images, texts = torch.randn(rows, 64, device=device), torch.randn(rows, 32, device=device)
    times: dict[str, list[float]] = {"local": [], "gathered": []}
    for step in range(warmup + steps):
        for way in ("local", "gathered"):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            outputs = {"image": model.module["image"](images), "text": model.module["text"](texts)}
            if way == "gathered":
                outputs = gather(outputs, rows, device, differentiable=True)
            loss = _clip_loss(outputs["image"], outputs["text"])
            optim.zero_grad()
            loss.backward()
            optim.step()
            if cuda:
                torch.cuda.synchronize()
            if step >= warmup:
                times[way].append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    release_process_group_at_exit()


def clip_bytes(world_size: int) -> dict[str, int]:
    """Bytes each rank holds for a CLIP-sized step: its outputs, the gathered outputs, and their gradient."""
    local = 2 * CLIP_ROWS * CLIP_WIDTH * torch.tensor([], dtype=torch.float32).element_size()
    return {"local_outputs": local, "gathered_outputs": world_size * local, "gathered_gradient": world_size * local}


def measure(mode: str, device_kind: str, world_size: int = 2) -> dict[str, Any]:
    """Step times of both ways (seconds, per timed step on rank 0), their ratio, and ``clip_bytes``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        from benchmarks.ddp_suite import free_port

        mp.spawn(_rank, args=(world_size, free_port(), mode, device_kind, str(out)), nprocs=world_size)
        times = json.loads(out.read_text())
    ratios = [gathered / local for local, gathered in zip(times["local"], times["gathered"], strict=True)]
    return {
        "world_size": world_size,
        "rows_per_rank": _SETTINGS[mode][0],
        "local_s": statistics.median(times["local"]),
        "gathered_s": statistics.median(times["gathered"]),
        "ratios": ratios,
        "bytes": clip_bytes(world_size),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print one line: both step times, their ratio, and the CLIP-sized bytes."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gather", description=__doc__.split("\n\n")[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true")
    speed.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    result = measure("smoke" if args.smoke else "quick" if args.quick else "full", args.device)
    sizes = result["bytes"]
    print(
        f"gather_step_end on {result['world_size']} processes, {result['rows_per_rank']} rows per rank: step"
        f" {result['local_s'] * 1e3:.2f} ms without, {result['gathered_s'] * 1e3:.2f} ms with, ratio"
        f" {statistics.median(result['ratios']):.2f} [{min(result['ratios']):.2f}, {max(result['ratios']):.2f}]."
        f" CLIP-sized ({CLIP_ROWS} rows x {CLIP_WIDTH}, two towers, float32), bytes per rank: own outputs"
        f" {sizes['local_outputs']:,}, gathered {sizes['gathered_outputs']:,}, their gradient"
        f" {sizes['gathered_gradient']:,}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
