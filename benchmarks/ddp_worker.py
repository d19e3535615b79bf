"""One rank of a multi-process job (``benchmarks.ddp_suite`` starts it with the ranks in its environment).

Variants: ``torch`` (a hand-written ``DistributedDataParallel`` loop, no Lightning imported), ``ddp`` (Lightning's),
``mgpu_ddp``, and ``mgpu_ddp_profile`` (under cProfile). All take the same model, rows (a non-shuffling
``DistributedSampler``), batch per process, optimizer and steps, and time the same span, from the first timed batch
fetched to the end of the last timed optimizer step. Writes ``--out/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.models import ModelSpec, build_net, dataset, loss_of, mode_settings, optimizer
from lightning_mgpu.strategies.ddp import release_process_group_at_exit

PROFILE_SUFFIX = "_profile"


def run_torch(spec: ModelSpec, kind: str, rank: int, world_size: int) -> tuple[list[float], list[float]]:
    """The hand-written DDP loop; the wall and main-thread CPU seconds of each timed step."""
    local_rank = int(os.environ["LOCAL_RANK"])  # one process per GPU
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method="env://")
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (the old name warns); mgpu_ddp does the same.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    ddp_args: dict[str, Any] = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
    if kind == "cuda":
        ddp_args.update(device_ids=[local_rank], output_device=local_rank)
    model = DistributedDataParallel(build_net(spec).to(device), **ddp_args)
    optim = optimizer(model.parameters())
    data = dataset(spec, spec.batch * world_size * (spec.warmup + spec.steps))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    marks: list[tuple[float, float]] = []
    for index, batch in enumerate(DataLoader(data, batch_size=spec.batch, sampler=sampler)):
        if index >= spec.warmup:
            if kind == "cuda" and index == spec.warmup:
                torch.cuda.synchronize()
            marks.append((time.perf_counter(), time.thread_time()))
        loss = loss_of(model, [tensor.to(device, non_blocking=True) for tensor in batch])
        optim.zero_grad()
        loss.backward()
        optim.step()
    if kind == "cuda":
        torch.cuda.synchronize()
    marks.append((time.perf_counter(), time.thread_time()))
    wall, cpu = ([end[i] - start[i] for start, end in itertools.pairwise(marks)] for i in (0, 1))
    return wall, cpu


def run_lightning(
    strategy: str, spec: ModelSpec, kind: str, world_size: int, profile: bool
) -> tuple[list[float], list[float], dict[str, Any] | None]:
    """One fit under ``strategy``: wall and main-thread CPU seconds per timed step, and with ``profile`` a summary."""
    import lightning_mgpu  # noqa: F401 - registers mgpu_ddp
    from benchmarks.modules import BenchModule, StepTimer, quiet_lightning, trainer_for
    from benchmarks.profiling import CProfileSteps

    quiet_lightning()
    timer = StepTimer(spec.warmup, spec.steps)
    profiler = CProfileSteps(timer) if profile else None
    callbacks = [timer] if profiler is None else [timer, profiler]
    trainer = trainer_for(callbacks, spec.warmup + spec.steps, strategy, world_size, "gpu" if kind == "cuda" else "cpu")
    rows = spec.batch * world_size * (spec.warmup + spec.steps)
    trainer.fit(BenchModule(spec), DataLoader(dataset(spec, rows), batch_size=spec.batch, shuffle=False))
    durations = timer.durations()
    summary = None if profiler is None else profiler.summary(sum(durations), spec.steps)
    return durations, timer.durations(column=1), summary


def main() -> None:
    """Run the variants given on the command line and write this rank's timings."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", required=True, help="comma-separated: torch, ddp, mgpu_ddp, mgpu_ddp_profile")
    parser.add_argument("--models", required=True, help="comma-separated: mlp, conv")
    parser.add_argument("--mode", required=True, choices=["smoke", "quick", "full"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=1, help="run the variants in turn this many times")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    specs = {spec.name: spec for spec in mode_settings(args.mode, args.device).models}
    results = []
    for _, variant, model in itertools.product(range(args.rounds), args.variants.split(","), args.models.split(",")):
        spec, profile = specs[model], None
        if variant == "torch":
            durations, cpu_durations = run_torch(spec, args.device, rank, world_size)
        else:
            strategy = variant.removesuffix(PROFILE_SUFFIX)
            durations, cpu_durations, profile = run_lightning(
                strategy, spec, args.device, world_size, variant != strategy
            )
        results.append({"variant": variant, "model": model, "durations": durations, "cpu_durations": cpu_durations,
                        "batch": spec.batch, "profile": profile})  # fmt: skip
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    release_process_group_at_exit()  # as mgpu_ddp does, so that the hand-written loop's gloo threads end cleanly too


if __name__ == "__main__":
    main()
