"""One rank of a multi-process benchmark job, started by ``benchmarks.ddp_suite`` with the ranks in its environment.

``python -m benchmarks.ddp_worker --variants torch,ddp,mgpu_ddp --models mlp,conv --mode quick --device cpu
--out DIR`` runs each variant on each model in turn and writes ``DIR/rank<R>.json``. The variants:

- ``torch``: a hand-written loop around ``torch.nn.parallel.DistributedDataParallel`` (no Lightning imported);
- ``ddp``: Lightning's stock ``strategy="ddp"``;
- ``mgpu_ddp``: this package's ``strategy="mgpu_ddp"``;
- ``mgpu_ddp_profile``: ``mgpu_ddp`` under cProfile (its timings are not used).

All take the same model (same seed), the same synthetic rows sharded by a non-shuffling ``DistributedSampler``, the
same batch per process, optimizer and steps, and time the same span: from the moment the first timed batch has been
fetched to the end of the last timed optimizer step.
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

from benchmarks.models import ModelSpec, build_net, dataset, loss_of, mode_settings, optimizer, spec_of

PROFILE_SUFFIX = "_profile"
"""A variant name ending in this (``mgpu_ddp_profile``) runs that strategy under cProfile instead of timing it."""
EXIT_GRACE_S = 0.1
"""How long a rank leaves the GIL to gloo's threads before it exits."""


def _buffer_sync_keyword() -> str:
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (the old name warns); mgpu_ddp does the same.
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"


def _device(kind: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")


def _rows(spec: ModelSpec, world_size: int) -> int:
    return spec.batch * world_size * (spec.warmup + spec.steps)


def run_torch(
    spec: ModelSpec, kind: str, rank: int, local_rank: int, world_size: int
) -> tuple[list[float], list[float]]:
    """The hand-written DDP loop; returns the wall and main-thread CPU seconds of each timed step.

    Steps are marked where ``StepTimer`` marks them in a Lightning run: after the batch is fetched.
    """
    device = _device(kind, local_rank)
    if kind == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method="env://")
    net = build_net(spec).to(device)
    ddp_args: dict[str, Any] = {"device_ids": [local_rank], "output_device": local_rank} if kind == "cuda" else {}
    ddp_args[_buffer_sync_keyword()] = False
    model = DistributedDataParallel(net, **ddp_args)
    optim = optimizer(model.parameters())
    data = dataset(spec, _rows(spec, world_size))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=spec.batch, sampler=sampler)
    last = spec.warmup + spec.steps - 1
    marks: list[float] = []
    cpu_marks: list[float] = []
    for index, batch in enumerate(loader):
        if index == spec.warmup:
            _synchronize(kind)
        if index >= spec.warmup:
            cpu_marks.append(time.thread_time())
            marks.append(time.perf_counter())
        batch = [tensor.to(device, non_blocking=True) for tensor in batch]
        loss = loss_of(model, batch)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if index == last:
            _synchronize(kind)
            cpu_marks.append(time.thread_time())
            marks.append(time.perf_counter())
            return _steps(marks), _steps(cpu_marks)
    raise RuntimeError(f"the loader of {spec.name} ran out before step {last}")


def run_lightning(
    strategy: str, spec: ModelSpec, kind: str, world_size: int, profile: bool = False
) -> tuple[list[float], list[float], dict[str, Any] | None]:
    """One Lightning fit under ``strategy`` (``"ddp"`` or ``"mgpu_ddp"``).

    Returns:
        The wall and main-thread CPU seconds of each timed step, and with ``profile`` a cProfile summary of them.
    """
    import lightning as L

    import lightning_mgpu  # noqa: F401 - registers mgpu_ddp
    from benchmarks.modules import BenchModule, StepTimer, quiet_lightning, trainer_for
    from benchmarks.profiling import ProfileSteps, summarize

    quiet_lightning()
    timer = StepTimer(spec.warmup, spec.steps)
    profiler = ProfileSteps(timer) if profile else None
    accelerator = "gpu" if kind == "cuda" else "cpu"
    extra: list[L.Callback] = [profiler] if profiler is not None else []
    trainer = trainer_for(timer, spec.warmup + spec.steps, strategy, world_size, accelerator, extra_callbacks=extra)
    loader = DataLoader(dataset(spec, _rows(spec, world_size)), batch_size=spec.batch, shuffle=False)
    trainer.fit(BenchModule(spec), loader)
    durations = timer.durations()
    if profiler is None:
        return durations, timer.cpu_durations(), None
    return durations, timer.cpu_durations(), summarize(profiler.stats().stats, sum(durations), spec.steps, 0, top=10)  # type: ignore[attr-defined]


def _steps(marks: list[float]) -> list[float]:
    return [end - start for start, end in itertools.pairwise(marks)]


def _synchronize(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    """Run the variants given on the command line and write this rank's timings."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", required=True, help="comma-separated: torch, ddp, mgpu_ddp")
    parser.add_argument("--models", required=True, help="comma-separated: mlp, conv")
    parser.add_argument("--mode", required=True, choices=["smoke", "quick", "full"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=1, help="run the variants in turn this many times")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    mode = mode_settings(args.mode, args.device)
    results = []
    runs = [(v, m) for _ in range(args.rounds) for v in args.variants.split(",") for m in args.models.split(",")]
    for variant, model in runs:
        spec = spec_of(mode, model)
        profile = None
        if variant == "torch":
            durations, cpu_durations = run_torch(spec, args.device, rank, local_rank, world_size)
        else:
            strategy = variant.removesuffix(PROFILE_SUFFIX)
            durations, cpu_durations, profile = run_lightning(
                strategy, spec, args.device, world_size, variant != strategy
            )
        results.append(
            {
                "variant": variant,
                "model": model,
                "world_size": world_size,
                "durations": durations,
                "cpu_durations": cpu_durations,
                "batch": spec.batch,
                "profile": profile,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "results": results}))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Gloo's threads outlive the group (torch keeps references to it) and may still need the GIL to free the last
    # all-reduce of a backward; a rank that exits before they get it dies of SIGABRT in interpreter finalization.
    # mgpu_ddp registers the same pause at exit (release_process_group_at_exit), the torch and ddp variants do not,
    # and a job of the hand-written loop alone imports no Lightning.
    time.sleep(EXIT_GRACE_S)


if __name__ == "__main__":
    main()
