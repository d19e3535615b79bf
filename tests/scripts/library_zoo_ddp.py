"""Train the named library-zoo entries one after another in one two-process mgpu_ddp job (Lightning's launcher).

Each rank trains each entry with ``MGPUDDPStrategy(uneven_batches=True)`` and saves what it ended with to
``--out/<entry>.rank<r>.pt``, or the traceback to ``--out/<entry>.rank<r>.error``, and goes on with the next entry,
so one entry's failure leaves the others' results. Read by tests/test_library_zoo.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from library_zoo import DDP_BATCH, DDP_WORLD_SIZE, ZOO, ddp_loader, train  # noqa: E402

import lightning_mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for the other rank")
    parser.add_argument("names", nargs="+", choices=sorted(ZOO))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it in the ranks it starts
    for name in args.names:
        entry = ZOO[name]
        try:
            outcome = train(
                entry,
                ddp_loader(entry, DDP_BATCH),
                accelerator="cpu",
                devices=DDP_WORLD_SIZE,
                strategy=lightning_mgpu.MGPUDDPStrategy(uneven_batches=True, timeout=timedelta(seconds=args.timeout)),
            )
        except Exception:  # every rank fails alike before training starts (model checks), so both go on
            (args.out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            continue
        torch.save(dataclasses.asdict(outcome), args.out / f"{name}.rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 ends the job: wait until every rank has written its results


if __name__ == "__main__":
    main()
