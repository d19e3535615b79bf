"""A training script that calls ``lightning_mgpu.parse_local_rank()`` first, as scripts run by every launcher may.

Writes ``rank<r>.done`` under ``--out`` from each rank that finished; tests/test_launch.py runs it directly (Lightning
starts the second process), under ``torch.distributed.launch`` and under torchrun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import Regressor, loader, regression_data  # noqa: E402

import lightning_mgpu  # noqa: E402


def main() -> None:
    local_rank = lightning_mgpu.parse_local_rank()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="mgpu_ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader(regression_data(), 4))
    (args.out / f"rank{trainer.global_rank}.done").write_text(str(local_rank))


if __name__ == "__main__":
    main()
