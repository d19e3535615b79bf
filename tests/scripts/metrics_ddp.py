"""torchmetrics' metrics updated in ``validation_step`` under ``mgpu_dp``'s sibling ``mgpu_ddp``, on 2 gloo ranks.

Run twice in a row in the same processes, each time with a fresh model; rank 0 writes each run's computed values
(torchmetrics synchronises the ranks' states in ``compute()``) to ``--out/run<N>.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metric_matrix import MetricMatrix, data  # noqa: E402

import lightning_mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_mgpu.MGPUDDPStrategy(),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    for run in range(2):
        model = MetricMatrix()
        trainer.validate(model, data(), verbose=False)
        if trainer.global_rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(model.results, args.out / f"run{run}.pt")


if __name__ == "__main__":
    main()
