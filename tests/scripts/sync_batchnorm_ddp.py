"""Train ``BatchNormNet`` under ``mgpu_ddp`` with ``Trainer(sync_batchnorm=True)`` on CPU processes, once per case.

Cases: ``even`` (Lightning's sampler, rows the ranks divide) and ``uneven`` (``uneven_batches=True``). Each rank
writes ``<case>.rank<N>.pt``: its state dict after ``fit`` and the BatchNorm classes it trained with;
tests/test_sync_batchnorm.py compares them with one device.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import BatchNormNet, image_data  # noqa: E402

import lightning_mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("cases", nargs="+", help="<even|uneven>:<rows>")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for case in args.cases:
        kind, rows = case.split(":")
        strategy = lightning_mgpu.MGPUDDPStrategy(uneven_batches=kind == "uneven", timeout=timedelta(seconds=60))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            sync_batchnorm=True,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = BatchNormNet()
        trainer.fit(model, DataLoader(image_data(int(rows)), batch_size=args.batch, shuffle=False))
        result = {"state": model.state_dict(), "layer_types": model.layer_types, "steps": trainer.global_step}
        torch.save(result, args.out / f"{kind}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
