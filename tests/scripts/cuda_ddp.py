"""Fit a tiny model under mgpu_ddp, one process per GPU; each rank writes what it saw under --out.

Started by ``tests/test_cuda.py`` through Lightning's own launcher (``devices=2``), which re-runs this script for
rank 1. Each rank writes ``rank<R>.json`` (its rank, the current CUDA device and the process group's backend as read
inside ``training_step``, where its parameters and batch live, DDP's ``device_ids`` and ``output_device``) and
``params-rank<R>.pt`` (its final state dict, on the CPU), so the test can check that every rank trained on its own
GPU over NCCL and that the ranks ended with the same parameters. ``--accelerator cpu`` runs the same on CPU
processes with gloo, which is how the script is checked on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import Regressor, regression_data  # noqa: E402

import lightning_mgpu  # noqa: E402


class Probe(Regressor):
    """Records, in its first training step, where the rank runs: by then the process group and DDP exist."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.seen:
            wrapper = self.trainer.strategy.model
            self.seen = {
                "rank": self.global_rank,
                "world_size": self.trainer.world_size,
                "current_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
                "backend": dist.get_backend(),
                "param_device": str(next(self.parameters()).device),
                "batch_device": str(batch[0].device),
                "wrapper": type(wrapper).__name__,
                "device_ids": getattr(wrapper, "device_ids", None),
                "output_device": getattr(wrapper, "output_device", None),
            }
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    model = Probe()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=lightning_mgpu.MGPUDDPStrategy(timeout=timedelta(seconds=args.timeout)),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.out,
    )
    trainer.fit(model, DataLoader(regression_data(rows=32), batch_size=4, shuffle=False))

    rank = trainer.global_rank
    (args.out / f"rank{rank}.json").write_text(json.dumps(model.seen))
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    torch.save(state, args.out / f"params-rank{rank}.pt")


if __name__ == "__main__":
    main()
