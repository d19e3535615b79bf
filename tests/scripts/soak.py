"""Long run under mgpu_dp (virtual replicas) or mgpu_ddp: resident memory, threads and open files must stay flat.

    python tests/scripts/soak.py --strategy mgpu_dp --steps 2000
    python tests/scripts/soak.py --strategy mgpu_ddp --steps 500

Prints one JSON line per rank with the measurements; exits 1 if anything grew past its bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import StepEndRegressor, regression_data  # noqa: E402

import lightning_mgpu  # noqa: E402, F401 - registers the strategies

RSS_GROWTH_LIMIT_MB = 20.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


class Measure(L.Callback):
    """Samples memory, threads, files and live tensors after warm-up and at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.samples: dict[str, dict[str, float]] = {}

    def _sample(self) -> dict[str, float]:
        gc.collect()
        tensors = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
        return {"rss_mb": _rss_mb(), "threads": threading.active_count(), "files": _open_files(), "tensors": tensors}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.samples["after_warmup"] = self._sample()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.samples["end"] = self._sample()


def main() -> int:
    parser = lightning_mgpu.add_local_rank_argument(argparse.ArgumentParser())
    parser.add_argument("--strategy", choices=["mgpu_dp", "mgpu_ddp"], required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure = Measure(warmup=min(200, args.steps // 4))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure],
    )
    data = DataLoader(regression_data(rows=64), batch_size=8, shuffle=True)
    trainer.fit(StepEndRegressor(), data)
    start, end = measure.samples["after_warmup"], measure.samples["end"]
    growth = {key: end[key] - start[key] for key in start}
    ok = growth["rss_mb"] < RSS_GROWTH_LIMIT_MB and growth["threads"] <= 0 and growth["files"] <= 0
    ok = ok and growth["tensors"] <= 0
    report = {"rank": trainer.global_rank, "steps": trainer.global_step, "start": start, "end": end, "growth": growth,
              "ok": ok}  # fmt: skip
    # One write of the whole line: every rank writes to the same pipe, and a line shorter than the pipe's buffer
    # written at once is never interleaved with another rank's output.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
