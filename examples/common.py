"""What the examples share: predictions written by dataset index from every process, and the command line."""

from __future__ import annotations

import csv
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_mgpu

ROOT = Path(__file__).resolve().parents[1]


def gather_to_rank_zero(trainer: L.Trainer, rows: dict[int, list[float]]) -> dict[int, list[float]]:
    """Every process's rows, by dataset index, on global rank 0 (the others get theirs back); a collective under DDP.

    Rows of the same index (a sampler that repeats samples to even out the processes) are kept once.
    """
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return rows
    gathered: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
    torch.distributed.gather_object(rows, gathered, dst=0)
    if gathered is None:
        return rows
    return {index: row for rank_rows in gathered for index, row in rank_rows.items()}


def write_csv(path: str, header: Sequence[str], rows: dict[int, list[float]]) -> str:
    """Write ``header`` and one line per index, in index order, as ``index, *row``; return ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows([index, *rows[index]] for index in sorted(rows))
    return path


def run_example(script: str, model: str, data: str, args: Sequence[str] | None, default_args: Sequence[str]) -> int:
    """Run an example's LightningCLI with ``model`` and ``data`` (class paths) on ``args``, or else the command line.

    Without arguments it runs ``default_args``. The model and data are given by class path before the other
    arguments, so a config's own ``class_path`` still wins.
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # so the class paths resolve whatever the current directory
    from lightning_mgpu.cli.run import run_with_classes

    if args is None:
        lightning_mgpu.parse_local_rank()  # torch.distributed.launch passes --local-rank=N before the arguments
    argv = sys.argv[1:] if args is None else args
    return run_with_classes(model, data, argv, default_args, f"python examples/{Path(script).name}")
